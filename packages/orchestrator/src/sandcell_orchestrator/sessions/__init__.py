"""Runtime sessions: the sandbox lifecycle, turns on top of it, checkpoints and inputs."""
