"""Sandbox backends, one module per backend; each is imported only when configured."""
