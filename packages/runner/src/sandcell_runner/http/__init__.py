"""The runner's HTTP surface (Starlette): the app, one module per group of routes,
and the plumbing every route module shares (``base``)."""
