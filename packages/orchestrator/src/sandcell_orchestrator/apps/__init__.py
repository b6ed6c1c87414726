"""App sandboxes: template instances with a dev server, a live preview and diagnostics.

As a library::

    instances = AppInstances(services.manager, templates=TemplateRegistry(settings.templates),
                             settings=settings)
    async with InstanceSupervisor(instances).running():
        created = await instances.create(
            CreateInstance(template="python-web", project_name="demo"), owner="default")
        print(created.url)

On ``sandcell serve`` the same API is HTTP (``routes.py``), with the preview at
``/preview/<instance_id>/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import AppRunnerClient
    from .errors import AppRequestError, InstanceNotFoundError, InstanceStartError
    from .instance import Instance
    from .instances import AppInstances
    from .lifecycle import InstanceSupervisor
    from .messages import (
        CommandOutcome,
        CommandResults,
        CreateInstance,
        FilesWritten,
        FileWrite,
        InstanceCreated,
        InstanceInfo,
        InstanceList,
        RunCommands,
        WriteFiles,
    )
    from .policy import DEFAULT_RULES, CommandDeniedError, CommandPolicy, PolicyRule
    from .preview import PreviewProxy
    from .routes import AppService, install_app_routes
    from .settings import AppSettings, GitAuthor
    from .templates import (
        Template,
        TemplateError,
        TemplateManifest,
        TemplateNotFoundError,
        TemplateRegistry,
        parse_manifest,
    )
    from .webhooks import Delivery, WebhookSender, sign, verify_signature

__all__ = [
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

_HOMES: dict[str, str] = {
    "AppInstances": "instances",
    "AppRequestError": "errors",
    "AppRunnerClient": "client",
    "AppService": "routes",
    "AppSettings": "settings",
    "CommandDeniedError": "policy",
    "CommandOutcome": "messages",
    "CommandPolicy": "policy",
    "CommandResults": "messages",
    "CreateInstance": "messages",
    "DEFAULT_RULES": "policy",
    "Delivery": "webhooks",
    "FileWrite": "messages",
    "FilesWritten": "messages",
    "GitAuthor": "settings",
    "Instance": "instance",
    "InstanceCreated": "messages",
    "InstanceInfo": "messages",
    "InstanceList": "messages",
    "InstanceNotFoundError": "errors",
    "InstanceStartError": "errors",
    "InstanceSupervisor": "lifecycle",
    "PolicyRule": "policy",
    "PreviewProxy": "preview",
    "RunCommands": "messages",
    "Template": "templates",
    "TemplateError": "templates",
    "TemplateManifest": "templates",
    "TemplateNotFoundError": "templates",
    "TemplateRegistry": "templates",
    "WebhookSender": "webhooks",
    "WriteFiles": "messages",
    "install_app_routes": "routes",
    "parse_manifest": "templates",
    "sign": "webhooks",
    "verify_signature": "webhooks",
}
"""Where each public name lives: its module is imported on first use."""


def __getattr__(name: str) -> object:
    # Lazy: the orchestrator's settings read AppSettings at every start-up, and
    # must not pull the app API (Starlette routes, the preview proxy, webhooks) in.
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
