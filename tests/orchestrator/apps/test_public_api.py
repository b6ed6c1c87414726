"""The app package's public API is exported on purpose."""

from __future__ import annotations

import sandcell_orchestrator.apps as apps


def test_all_is_pinned() -> None:
    assert sorted(apps.__all__) == sorted(
        [
            "DEFAULT_RULES",
            "AppInstances",
            "AppRequestError",
            "AppRunnerClient",
            "AppService",
            "AppSettings",
            "CommandDeniedError",
            "CommandOutcome",
            "CommandPolicy",
            "CommandResults",
            "CreateInstance",
            "Delivery",
            "FileWrite",
            "FilesWritten",
            "GitAuthor",
            "Instance",
            "InstanceCreated",
            "InstanceInfo",
            "InstanceList",
            "InstanceNotFoundError",
            "InstanceStartError",
            "InstanceSupervisor",
            "PolicyRule",
            "PreviewProxy",
            "RunCommands",
            "Template",
            "TemplateError",
            "TemplateManifest",
            "TemplateNotFoundError",
            "TemplateRegistry",
            "WebhookSender",
            "WriteFiles",
            "install_app_routes",
            "parse_manifest",
            "sign",
            "verify_signature",
        ]
    )
    for name in apps.__all__:
        assert getattr(apps, name) is not None
