"""The public API is exported on purpose."""

from __future__ import annotations

import sandcell_protocol


def test_all_is_pinned() -> None:
    assert sorted(sandcell_protocol.__all__) == sorted(
        name
        for name in dir(sandcell_protocol)
        if not name.startswith("_") or name == "__version__"
        if name
        not in {
            "annotations",
            "base",
            "codec",
            "derivations",
            "errors",
            "messages",
            "version",
            "schema",
            "input_refs",
        }
    )
    for name in sandcell_protocol.__all__:
        assert hasattr(sandcell_protocol, name)
