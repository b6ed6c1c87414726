"""The public names of the bootstrap, CLI and service modules are chosen on purpose."""

from __future__ import annotations

from sandcell_orchestrator import bootstrap, cli
from sandcell_orchestrator.serve import app as service_app


def test_public_names_are_pinned() -> None:
    assert sorted(bootstrap.__all__) == [
        "Services",
        "open_provider",
        "open_registry",
        "open_services",
    ]
    assert sorted(cli.__all__) == ["CLI_NAMESPACE", "build_parser", "job_exit_code", "main"]
    assert sorted(service_app.__all__) == [
        "INSECURE_NO_AUTH_ENV",
        "MAX_BODY_BYTES",
        "SessionInfo",
        "SessionList",
        "create_app",
        "map_error",
        "serve",
    ]
    for module in (bootstrap, cli, service_app):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
