"""Where jobs run: workspace directories and their quota mounts, link-safe file
operations, the bound session's state and its files."""
