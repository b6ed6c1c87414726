"""The public API is exported on purpose."""

from __future__ import annotations

import types

import sandcell_protocol


def test_all_is_pinned() -> None:
    # A submodule is an attribute of the package once anything imported it (the
    # runner imports env_vars…), so one counts only where it is exported on purpose,
    # whatever else the process happened to import first.
    exported = set(sandcell_protocol.__all__)
    assert sorted(exported) == sorted(
        name
        for name in dir(sandcell_protocol)
        if not name.startswith("_") or name == "__version__"
        if name != "annotations"
        if name in exported or not isinstance(getattr(sandcell_protocol, name), types.ModuleType)
    )
    for name in sandcell_protocol.__all__:
        assert hasattr(sandcell_protocol, name)
