"""``sandcell serve``: the orchestrator as an HTTP service (app, auth, error mapping)."""
