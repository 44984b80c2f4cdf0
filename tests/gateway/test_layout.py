"""The house rules, read from the source: only ``gateway.vllm`` imports vLLM; the client and
codec import nothing of the gateway or the benchmark, and the gateway nothing of the
benchmark; no import arrow runs in a circle among the gateway's modules. Imports inside
functions count (they are arrows too); ``if TYPE_CHECKING:`` blocks do not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("codec", "client", "gateway")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports, anywhere but TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            # ``from .pkg import module`` imports that module too.
            for alias in node.names:
                candidate = f"{stem}.{alias.name}"
                if (ROOT / Path(*candidate.split("."))).with_suffix(".py").exists():
                    found.add(candidate)
    return found


def project_modules() -> dict[str, set[str]]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = imports_of(path)
    return modules


# The client modules that may import vLLM, each for a user who has it installed: the
# trainer's adapter to vLLM's trainer-engine factory (the ``trainer`` extra), the
# multimodal helper that runs vLLM's processor (the ``multimodal`` extra), and the fixes for
# vLLM's CPU wheel that both of those and the gateway apply.
CLIENT_VLLM_ADAPTERS = ("client.vllm_trainer", "client.multimodal_processor", "client.vllm_wheel")


def test_only_the_vllm_package_imports_vllm():
    offenders = {
        name: sorted(i for i in imports if i == "vllm" or i.startswith("vllm."))
        for name, imports in project_modules().items()
        if not name.startswith("gateway.vllm") and name not in CLIENT_VLLM_ADAPTERS
    }
    assert {n: i for n, i in offenders.items() if i} == {}


def test_client_and_codec_stand_alone_and_the_gateway_does_not_use_the_bench():
    forbidden = {
        "codec": ("client", "gateway", "bench", "zmq"),
        "client": ("gateway", "bench"),
        "gateway": ("bench",),
    }
    for name, imports in project_modules().items():
        top = name.split(".")[0]
        for imported in imports:
            assert imported.split(".")[0] not in forbidden[top], f"{name} imports {imported}"


def test_no_import_arrow_runs_in_a_circle_among_the_gateways_modules():
    modules = {n: i for n, i in project_modules().items() if n.startswith("gateway")}
    graph = {
        name: {i for i in imports if i in modules and i != name}
        for name, imports in modules.items()
    }
    # A package's __init__ re-exports its modules: an arrow into a package is one into the
    # modules it re-exports, so the package itself is no node of a cycle.
    for package in ("gateway", "gateway.vllm"):
        graph[package] = set()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert cycles == []


def test_the_benchmark_harness_imports_no_probe():
    """bench/ is the harness a user runs; bench/probes/ the one-off investigations, which may
    use the harness but never the other way round (issue 49). Each probe is listed in
    bench/probes/README.md with its question and result."""
    harness = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        name = module_name(path)
        if not name.startswith("bench.probes"):
            harness[name] = imports_of(path)
    assert harness, "no harness modules found"
    offenders = {
        n: sorted(i for i in imp if i.startswith("bench.probes")) for n, imp in harness.items()
    }
    assert {n: i for n, i in offenders.items() if i} == {}
    index = (ROOT / "bench" / "probes" / "README.md").read_text()
    probes = {p.stem for p in (ROOT / "bench" / "probes").glob("*.py") if p.stem != "__init__"}
    assert probes and all(f"| `{probe}` |" in index for probe in probes)


# The session table's rooms (gateway/sessions.py's docstring): one entry point, each concern
# in a module of its own, none of them a room every feature has to read whole.
SESSION_TABLE_MODULES = (
    "sessions",
    "session_model",
    "admission",
    "request_outputs",
    "session_queries",
    "limits",
)
MAX_GATEWAY_FILE_LINES = 900
MAX_SESSION_METHOD_LINES = 60


def test_no_gateway_file_outgrows_its_bound():
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "gateway").rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_GATEWAY_FILE_LINES
    }
    assert too_long == {}


def test_no_function_of_the_session_tables_modules_outgrows_its_bound():
    too_long = {}
    for module in SESSION_TABLE_MODULES:
        tree = ast.parse((ROOT / "gateway" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_SESSION_METHOD_LINES:
                    too_long[f"{module}.{node.name}"] = lines
    assert too_long == {}
