"""The runner client: the only code that speaks HTTP to a runner."""
