"""Structure facts of the orchestrator package, checked from its source.

- No import cycle among its modules (module-level imports; imports under
  ``TYPE_CHECKING`` and inside functions are the lazy edges that break none).
- Vendor SDKs are imported only in their backend modules.
- A missing SDK is a ``ConfigError`` naming the extra that installs it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sandcell_orchestrator

PACKAGE = Path(sandcell_orchestrator.__file__).parent
NAME = "sandcell_orchestrator"

VENDOR_HOMES = {
    "boto3": {"providers/lambda_client.py"},
    "botocore": {"providers/lambda_client.py"},
    # The Redis registry: its core and one module per feature table beside it.
    "redis": {
        "registry/redis.py",
        "registry/redis_db.py",
        "registry/redis_e2b.py",
        "registry/redis_idempotency.py",
        "registry/redis_index.py",
        "registry/redis_slots.py",
        "providers/ratelimit_redis.py",
    },
    # The S3 store: its core, its upload and its error table.
    "minio": {"snapshots/s3.py", "snapshots/s3_upload.py", "snapshots/s3_errors.py"},
    "joserfc": {"serve/librechat/jwt.py"},
    "urllib3": {"snapshots/s3.py", "snapshots/s3_errors.py"},
    # envd's generated Connect code ships in the e2b package.
    "e2b": {"e2b/process.py", "e2b/filesystem.py"},
    "connectrpc": {
        "e2b/process.py",
        "e2b/filesystem.py",
        "e2b/errors.py",
        "e2b/envd.py",
        "e2b/codecs.py",
    },
    "protobuf": {"e2b/process.py", "e2b/filesystem.py"},
}
"""Each vendor SDK and the only modules that may import it."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module loads (not in functions, not TYPE_CHECKING)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    # "from pkg import mod" imports pkg.mod when mod is a module.
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for node in _top_level_imports(path):
            for target in _targets(module, path.name == "__init__.py", node):
                if target in files and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def test_no_import_cycle_inside_the_package() -> None:
    graph = _graph()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append([*stack[stack.index(node) :], node])
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            walk(target, [*stack, node])
        done.add(node)

    for module in sorted(graph):
        walk(module, [])
    assert cycles == []


def test_vendor_sdks_are_imported_only_in_their_backend_modules() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        for node in _top_level_imports(path):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                continue  # our own module (registry/e2b.py is not the e2b package)
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for name in names:
                root = name.split(".")[0]
                if root in VENDOR_HOMES and where not in VENDOR_HOMES[root]:
                    offenders.append(f"{where}: {name}")
    assert offenders == []


@pytest.mark.parametrize(
    ("hidden", "code", "extra"),
    [
        (
            "minio",
            "from sandcell_orchestrator.snapshots import open_snapshot_store\n"
            "open_snapshot_store('s3://snaps/p', default_dir=Path('/nonexistent'),"
            " env={'AWS_ACCESS_KEY_ID': 'a', 'AWS_SECRET_ACCESS_KEY': 'b'})",
            "s3",
        ),
        (
            "redis",
            "from sandcell_orchestrator.bootstrap import open_registry\n"
            "from sandcell_orchestrator.config import OrchestratorSettings\n"
            "open_registry(OrchestratorSettings.from_env("
            "{'SANDCELL_REGISTRY_URL': 'redis://127.0.0.1:1/0'}))",
            "redis",
        ),
        (
            "boto3",
            "from sandcell_orchestrator.providers import open_provider\n"
            "from sandcell_orchestrator.config import OrchestratorSettings\n"
            "open_provider(OrchestratorSettings.from_env({'SANDCELL_PROVIDER': 'lambda-microvm',"
            " 'SANDCELL_MICROVM_IMAGE': 'img'}).provider)",
            "aws",
        ),
    ],
)
def test_a_missing_sdk_names_the_extra_that_installs_it(hidden: str, code: str, extra: str) -> None:
    """Run where the SDK cannot be imported (as after a default install)."""
    script = (
        f"import sys\nsys.modules[{hidden!r}] = None\nfrom pathlib import Path\n"
        "from sandcell_orchestrator.errors import ConfigError\n"
        f"try:\n    exec({code!r})\nexcept ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert f"pip install 'sandcell-orchestrator[{extra}]'" in out.stdout
    assert hidden in out.stdout
