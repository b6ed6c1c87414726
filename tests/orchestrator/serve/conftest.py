"""The service tests launch real runners under the CLI suite's runtime directory fixture."""

from __future__ import annotations

from tests.orchestrator.cli.conftest import runtime_dir

__all__ = ["runtime_dir"]
