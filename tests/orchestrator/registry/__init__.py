"""Contract tests for the session registry (both backends) and the lease holder."""
