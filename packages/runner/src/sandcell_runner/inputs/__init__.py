"""Inputs the orchestrator pushes: the object-keyed input cache, its upload parser,
and priming (the only writer of inputs into a workspace)."""
