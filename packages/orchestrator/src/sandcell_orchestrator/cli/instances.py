"""``sandcell instances …``: the app-instance API of a running ``sandcell serve``, from a shell.

Instances live in the ``serve`` process that made them, so this is an HTTP
client of it (``--url``/``SANDCELL_URL``, ``--key``/``SANDCELL_API_KEY``), one
sub-command per route of ``docs/apps.md``. Answers print as JSON; an error
answer prints its code and message on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import httpx

from .common import UsageError

__all__ = ["EXIT_COMMAND_FAILED", "add_parser", "run_instances"]

EXIT_COMMAND_FAILED = 1
_DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(commands: Any) -> None:
    """Add ``instances …`` to the ``sandcell`` sub-command parsers."""
    parser = commands.add_parser("instances", help="app instances on a running sandcell serve")
    parser.add_argument("--url", help=f"the service [SANDCELL_URL or {_DEFAULT_URL}]")
    parser.add_argument("--key", help="an API key [SANDCELL_API_KEY]")
    actions = parser.add_subparsers(dest="instances_action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create an instance from a template")
    create.add_argument("template")
    create.add_argument("project_name", metavar="NAME")
    create.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument("--webhook-url", metavar="URL")
    actions.add_parser("ls", help="list this key's instances")
    for name, text in (("get", "one instance"), ("rm", "delete an instance")):
        actions.add_parser(name, help=text).add_argument("id")
    actions.add_parser("analysis", help="static analysis of the workspace").add_argument("id")
    write = actions.add_parser("write", help="write a file into the workspace")
    write.add_argument("id")
    write.add_argument("path", help="workspace path")
    write.add_argument("local", nargs="?", default="-", help="local file [- = stdin]")
    write.add_argument("--message", help="commit with this message")
    run = actions.add_parser("run", help="run commands in the workspace (bash -c each)")
    run.add_argument("id")
    run.add_argument("commands", nargs="+", metavar="COMMAND")
    run.add_argument("--timeout-s", type=float, help="per command [60, at most 600]")
    logs = actions.add_parser("logs", help="the dev server's last lines")
    logs.add_argument("id")
    logs.add_argument("--lines", type=int)
    logs.add_argument("--filter", metavar="REGEX")
    errors = actions.add_parser("errors", help="runtime errors (browser and server)")
    errors.add_argument("id")
    errors.add_argument("--since", type=float, metavar="EPOCH_S")
    errors.add_argument("--clear", action="store_true", help="clear the list instead")


def run_instances(
    args: argparse.Namespace, env: Mapping[str, str], out: TextIO, err: TextIO
) -> int:
    """Run one ``instances`` action against the service; the exit code."""
    key = args.key or env.get("SANDCELL_API_KEY")
    if not key:
        raise UsageError("instances: an API key is needed (--key or SANDCELL_API_KEY)")
    base = (args.url or env.get("SANDCELL_URL") or _DEFAULT_URL).rstrip("/")
    with httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=700, trust_env=False
    ) as client:
        try:
            return _dispatch(client, args, out, err)
        except httpx.HTTPError as exc:
            raise UsageError(f"instances: cannot reach {base} ({type(exc).__name__})") from None


def _dispatch(client: httpx.Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    action = args.instances_action
    one = f"/v1/instances/{args.id}" if hasattr(args, "id") else ""
    if action == "create":
        body: dict[str, Any] = {"template": args.template, "project_name": args.project_name}
        if args.env:
            body["env"] = dict(_pair(item) for item in args.env)
        if args.webhook_url:
            body["webhook_url"] = args.webhook_url
        return _show(client.post("/v1/instances", json=body), out, err)
    if action == "ls":
        return _show(client.get("/v1/instances"), out, err)
    if action == "get":
        return _show(client.get(one), out, err)
    if action == "analysis":
        return _show(client.get(f"{one}/analysis"), out, err)
    if action == "rm":
        return _show(client.delete(one), out, err)
    if action == "write":
        data = sys.stdin.buffer.read() if args.local == "-" else Path(args.local).read_bytes()
        item = {"path": args.path, "content": base64.b64encode(data).decode(), "encoding": "base64"}
        payload: dict[str, Any] = {"files": [item]}
        if args.message:
            payload["commit_message"] = args.message
        return _show(client.post(f"{one}/files", json=payload), out, err)
    if action == "run":
        payload = {"commands": args.commands}
        if args.timeout_s is not None:
            payload["timeout_s"] = args.timeout_s
        response = client.post(f"{one}/commands", json=payload)
        code = _show(response, out, err)
        if code == 0 and any(
            r["exit_code"] != 0 or r["status"] != "ok" for r in response.json()["results"]
        ):
            return EXIT_COMMAND_FAILED
        return code
    if action == "logs":
        params = {k: v for k, v in (("lines", args.lines), ("filter", args.filter)) if v}
        response = client.get(f"{one}/logs", params=params)
        if response.is_success:
            out.write("".join(line + "\n" for line in response.json()["lines"]))
            return 0
        return _show(response, out, err)
    # errors
    if args.clear:
        return _show(client.delete(f"{one}/runtime-errors"), out, err)
    since = {"since": args.since} if args.since is not None else {}
    return _show(client.get(f"{one}/runtime-errors", params=since), out, err)


def _show(response: httpx.Response, out: TextIO, err: TextIO) -> int:
    if response.is_success:
        if response.content:
            out.write(json.dumps(response.json(), indent=1) + "\n")
        return 0
    try:
        error = response.json()["error"]
        err.write(f"sandcell: {response.status_code} {error['code']}: {error['message']}\n")
    except (ValueError, KeyError, TypeError):
        err.write(f"sandcell: HTTP {response.status_code}\n")
    return 2


def _pair(raw: str) -> tuple[str, str]:
    key, sep, value = raw.partition("=")
    if not sep or not key:
        raise UsageError(f"--env wants KEY=VALUE, got {raw[:40]!r}")
    return key, value
