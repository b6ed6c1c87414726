"""A value's representations, as a notebook shows them: a MIME bundle."""

from __future__ import annotations

import base64
import io
import json
import sys
from typing import Any

__all__ = ["MIMES", "b64", "figure_png", "is_figure", "mimebundle"]

_TEXT_PLAIN_MAX = 1 << 20
_REPRS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
_BINARY = ("image/png", "image/jpeg")
MIMES = {mime for _, mime in _REPRS} | {"text/plain"}


def b64(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def figure_png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def is_figure(value: Any) -> bool:
    figure_module = sys.modules.get("matplotlib.figure")
    figure_type = getattr(figure_module, "Figure", None)
    return figure_type is not None and isinstance(value, figure_type)


def mimebundle(value: Any) -> dict[str, Any]:
    """Every representation ``value`` offers, richest first, plus ``text/plain``."""
    data: dict[str, Any] = {}
    bundle_method = getattr(value, "_repr_mimebundle_", None)
    if callable(bundle_method) and not isinstance(value, type):
        try:
            bundle = bundle_method()
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            if isinstance(bundle, dict):
                for mime, item in bundle.items():
                    if mime in MIMES and item is not None:
                        data[mime] = b64(item) if mime in _BINARY else item
        except Exception:  # noqa: S110 - a broken repr must not break the cell
            pass
    if not isinstance(value, type):
        for method_name, mime in _REPRS:
            if mime in data:
                continue
            method = getattr(value, method_name, None)
            if not callable(method):
                continue
            try:
                item = method()
            except Exception:  # noqa: S112 - nor may one representation
                continue
            if isinstance(item, tuple):
                item = item[0]
            if item is None:
                continue
            data[mime] = b64(item) if mime in _BINARY else item
        if "image/png" not in data and is_figure(value):
            data["image/png"] = b64(figure_png(value))
    if "text/plain" not in data:
        try:
            text = repr(value)
        except Exception as exc:
            text = f"<repr failed: {type(exc).__name__}: {exc}>"
        data["text/plain"] = text[:_TEXT_PLAIN_MAX]
    if "application/json" in data and isinstance(data["application/json"], str):
        try:
            data["application/json"] = json.loads(data["application/json"])
        except ValueError:
            del data["application/json"]
    return data
