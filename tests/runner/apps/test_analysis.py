"""Static analysis inside the jail: ruff, a compile check, tsc when configured."""

from __future__ import annotations

import shutil
from typing import Any

from tests.runner.apps.helpers import AppClient


def _analyse(app: AppClient) -> dict[str, Any]:
    response = app.http.get("/v1/session/analysis")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _tool(result: dict[str, Any], name: str) -> dict[str, Any]:
    (status,) = [t for t in result["tools"] if t["tool"] == name]
    return dict(status)


def test_syntax_error_and_ruff_finding_with_positions(app: AppClient) -> None:
    app.put("pkg/bad.py", "x = 1\ndef f(:\n    pass\n")
    app.put("lint.py", "import os\n\nprint(undefined_name)\n")
    app.put("node_modules/dep/skipped.py", "def broken(:\n")
    result = _analyse(app)
    assert _tool(result, "ruff") == {"tool": "ruff", "available": True, "detail": None}
    assert _tool(result, "python")["available"] is True
    found = {(d["tool"], d["file"], d["code"]): d for d in result["diagnostics"]}

    syntax = found[("python", "pkg/bad.py", "SyntaxError")]
    assert (syntax["line"], syntax["column"], syntax["severity"]) == (2, 7, "error")

    unused = found[("ruff", "lint.py", "F401")]
    assert (unused["line"], unused["column"], unused["severity"]) == (1, 8, "warning")
    assert "os" in unused["message"]
    undefined = found[("ruff", "lint.py", "F821")]
    assert (undefined["line"], undefined["column"], undefined["severity"]) == (3, 7, "error")
    assert any(d["tool"] == "ruff" and d["file"] == "pkg/bad.py" for d in result["diagnostics"])
    assert not any("node_modules" in d["file"] for d in result["diagnostics"])


def test_typescript_is_checked_only_where_tsc_exists(app: AppClient) -> None:
    result = _analyse(app)
    assert _tool(result, "tsc") == {"tool": "tsc", "available": False, "detail": "no tsconfig.json"}
    app.put("tsconfig.json", '{"compilerOptions": {"strict": true}, "include": ["src"]}')
    app.put("src/main.ts", "const n: number = 'text';\n")
    result = _analyse(app)
    tsc = _tool(result, "tsc")
    # Jobs see the host's /usr: the test command installs Debian's TypeScript for
    # the LibreChat ts language, but a machine without it must say so, not "clean".
    if shutil.which("tsc") is None:
        assert tsc["available"] is False
        assert "tsc not found" in tsc["detail"]
        return
    assert tsc["available"] is True
    found = [(d["file"], d["line"], d["code"]) for d in result["diagnostics"] if d["tool"] == "tsc"]
    assert ("src/main.ts", 1, "TS2322") in found


def test_a_fake_tsc_is_parsed(app: AppClient) -> None:
    """tsc's --pretty false format maps to diagnostics (a stand-in for a real tsc here)."""
    fake = (
        "#!/bin/sh\n"
        "echo \"src/main.ts(1,7): error TS2322: Type 'string' is not assignable.\"\n"
        "echo '  Extra detail line.'\n"
        "echo 'error TS5023: Unknown compiler option.'\n"
        "exit 2\n"
    )
    app.put("tsconfig.json", "{}")
    response = app.http.put("/v1/session/files/node_modules/.bin/tsc?mode=0755", content=fake)
    assert response.status_code == 200, response.text
    result = _analyse(app)
    assert _tool(result, "tsc")["available"] is True
    ts = [d for d in result["diagnostics"] if d["tool"] == "tsc"]
    assert ts[0]["file"] == ""
    assert ts[0]["code"] == "TS5023"
    first = ts[1]
    assert (first["file"], first["line"], first["column"], first["code"]) == (
        "src/main.ts",
        1,
        7,
        "TS2322",
    )
    assert first["message"].endswith("\nExtra detail line.")


def test_analysis_is_session_bound(app: AppClient) -> None:
    headers = {"X-Runtime-Session-Id": "not-a-session"}
    assert app.http.get("/v1/session/analysis", headers=headers).status_code == 400
