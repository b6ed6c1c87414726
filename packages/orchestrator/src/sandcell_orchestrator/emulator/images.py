"""MicroVM images in the emulator: enough of CreateMicrovmImage and its polling.

A build "takes" ``build_s`` and then succeeds (or fails, by fault). A VM launched
from a known image gets the image's ``environmentVariables`` in its runner's
environment, which is how ``scripts/create-microvm-image --env-json`` reaches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .vm import ServiceError, not_found

__all__ = ["Image", "ImageRegistry"]

_COPIED = (
    "baseImageArn",
    "buildRoleArn",
    "codeArtifact",
    "additionalOsCapabilities",
    "environmentVariables",
    "cpuConfigurations",
    "resources",
    "hooks",
)


@dataclass
class Image:
    arn: str
    name: str
    version: str
    request: dict[str, Any] = field(repr=False)
    created_at: float
    ready_at: float
    fails: bool

    def states(self, now: float) -> tuple[str, str]:
        """(image state, version state)."""
        if now < self.ready_at:
            return "CREATING", "IN_PROGRESS"
        return ("CREATE_FAILED", "FAILED") if self.fails else ("CREATED", "SUCCESSFUL")

    @property
    def env(self) -> dict[str, str]:
        return dict(self.request.get("environmentVariables") or {})


class ImageRegistry:
    """Images by name (and ARN)."""

    def __init__(
        self, *, arn_of: Callable[[str], str], clock: Callable[[], float], build_s: float
    ) -> None:
        self.images: dict[str, Image] = {}
        self._arn_of = arn_of
        self._clock = clock
        self.build_s = build_s

    def find(self, identifier: str) -> Image | None:
        """By name or ARN."""
        return self.images.get(identifier) or next(
            (i for i in self.images.values() if i.arn == identifier), None
        )

    def get(self, identifier: str) -> Image:
        image = self.find(identifier)
        if image is None:
            raise not_found("MicroVM image")
        return image

    def create(self, body: dict[str, Any], *, fails: bool) -> dict[str, object]:
        """CreateMicrovmImage."""
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise ServiceError(400, "ValidationException", "name is required")
        if name in self.images:
            raise ServiceError(409, "ConflictException", f"image {name} exists")
        image = Image(
            arn=self._arn_of(name),
            name=name,
            version="1.0",
            request=body,
            created_at=time.time(),
            ready_at=self._clock() + self.build_s,
            fails=fails,
        )
        self.images[name] = image
        return self.describe(image)

    def describe(self, image: Image) -> dict[str, object]:
        """GetMicrovmImage (and the CreateMicrovmImage answer)."""
        state, _ = image.states(self._clock())
        answer: dict[str, object] = {k: image.request[k] for k in _COPIED if k in image.request}
        answer |= {
            "imageArn": image.arn,
            "name": image.name,
            "state": state,
            "createdAt": image.created_at,
            "imageVersion": image.version,
        }
        if state == "CREATED":
            answer["latestActiveImageVersion"] = image.version
        return answer

    def version(self, identifier: str, version: str) -> tuple[Image, str]:
        """The image and its version's state."""
        image = self.get(identifier)
        if version != image.version:
            raise not_found("MicroVM image version")
        return image, image.states(self._clock())[1]

    def describe_version(self, identifier: str, version: str) -> dict[str, object]:
        """GetMicrovmImageVersion."""
        image, state = self.version(identifier, version)
        answer = self.describe(image) | {"state": state, "status": "ACTIVE"}
        if state == "FAILED":
            answer["stateReason"] = "the build failed (injected)"
        return answer

    def builds(self, identifier: str, version: str) -> dict[str, object]:
        """ListMicrovmImageBuilds: one build per version."""
        image, state = self.version(identifier, version)
        build: dict[str, object] = {
            "imageArn": image.arn,
            "imageVersion": image.version,
            "buildId": "build-1",
            "buildState": state if state in ("IN_PROGRESS", "SUCCESSFUL") else "FAILED",
            "architecture": "X86_64",
            "chipset": "INTEL",
            "chipsetGeneration": "emulated",
            "createdAt": image.created_at,
        }
        if build["buildState"] == "FAILED":
            build["stateReason"] = "the build failed (injected)"
        return {"items": [build]}

    def runnable(self, image: Image, version: str) -> None:
        """Refuse a launch from a version that does not exist or is not built."""
        if version != image.version:
            raise not_found(f"image version {version}")
        if image.states(self._clock())[1] != "SUCCESSFUL":
            raise ServiceError(409, "ConflictException", "the image version is not active")
