"""The architecture's import rules (ARCHITECTURE.md), checked statically and at import time.

- the engine imports no gRPC, protobuf, serving or CLI code;
- the gateway imports no torch and no engine;
- services import nothing from each other;
- the gateway's request runs (runs.py) import no gRPC: the verifier client maps its errors;
- `specinfer.serving` does not import `specinfer.cli`;
- the shared vocabulary (params, limits, stats, errors, tokenizer) imports no torch;
- no import circles among the project's modules (imports inside functions count too).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


RULES = {
    "specinfer/engine": ("grpc", "google.protobuf", "specinfer.v1", "specinfer.serving", "specinfer.cli", "services",
                         "opentelemetry", "prometheus_client"),
    "services/gateway": ("torch", "specinfer.engine", "specinfer.pool", "specinfer.serving.trees",
                         "services.verifier", "services.speculator"),
    "services/verifier": ("services.gateway", "services.speculator"),
    "services/speculator": ("services.gateway", "services.verifier"),
    "specinfer/serving": ("specinfer.cli", "services"),
}


@pytest.mark.parametrize("folder", list(RULES))
def test_static_import_rules(folder):
    assert violations(folder, RULES[folder]) == []


def test_the_gateway_runs_requests_without_grpc():
    """gRPC stays at the edges: the verifier client turns a failed call into a domain error."""
    assert not {n for n in imported_modules(ROOT / "services/gateway/runs.py") if n.split(".")[0] == "grpc"}


def test_the_rule_checker_has_teeth(tmp_path):
    (tmp_path / "bad.py").write_text("def f():\n    from specinfer.serving.convert import stats_to_proto\n")
    assert any("specinfer.serving" in n for n in imported_modules(tmp_path / "bad.py"))


PACKAGES = ("specinfer", "services")


def project_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every module under `packages`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def module_imports(name: str, path: Path, is_package: bool) -> set[str]:
    """What a module's import statements name, anywhere in it: `from x import y` names x and
    x.y (y may be a submodule); relative imports are resolved against `name`."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            named.add(module)
            named |= {f"{module}.{a.name}" for a in node.names}
    return named


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name that is not a module counts as the
    module that holds it: `from specinfer.limits import X` is specinfer.limits)."""
    modules = project_modules(root, packages)
    graph = {}
    for name, (path, is_package) in modules.items():
        edges = set()
        for target in module_imports(name, path, is_package):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state = {}  # module -> "open" while on the current path, "done" once all it reaches is searched
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = "open"
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = "done"
                stack.pop()
            elif state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = "open"
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return []


def test_no_import_circles():
    graph = import_graph(ROOT)
    assert "specinfer.engine.kernels.cuda_graphs" in graph["specinfer.engine.runtime.backend"]  # inside a function
    cycle = find_cycle(graph)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_the_circle_checker_has_teeth(tmp_path):
    pkg = tmp_path / "specinfer"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from specinfer.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import specinfer.limits\n\n\ndef g():\n    from ..a import X\n")
    graph = import_graph(tmp_path, ("specinfer",))
    assert find_cycle(graph) == ["specinfer.a", "specinfer.sub.b", "specinfer.sub.c", "specinfer.a"]
    (pkg / "sub" / "c.py").write_text("import specinfer.limits\n")
    assert find_cycle(import_graph(tmp_path, ("specinfer",))) == []


def loaded_after_import(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_gateway_loads_no_torch_and_no_engine():
    loaded = loaded_after_import(["services.gateway.server", "services.gateway.__main__"])
    assert "services.gateway.server" in loaded
    assert not {m for m in loaded if m == "torch" or m.startswith(("torch.", "specinfer.engine"))}


def test_the_engine_loads_no_grpc_protobuf_serving_or_cli():
    engine = sorted("specinfer.engine." + p.stem for p in (ROOT / "specinfer/engine").glob("*.py")
                    if p.stem != "__init__")
    loaded = loaded_after_import(engine)
    assert "specinfer.engine.loop" in loaded
    bad = {m for m in loaded if m.startswith(("grpc", "google.protobuf", "specinfer.serving", "specinfer.cli",
                                              "specinfer.v1", "services"))}
    assert not bad


def test_the_shared_vocabulary_loads_no_torch():
    loaded = loaded_after_import(["specinfer.params", "specinfer.limits", "specinfer.stats", "specinfer.errors",
                                  "specinfer.tokenizer", "specinfer.serving.convert"])
    assert "torch" not in loaded


def test_one_decode_loop():
    """Recording a verified step happens in the engine's loop only, not again in a service or the CLI."""
    pattern = re.compile(r"(?<![\w.])(run_step|\w+\.record_step)\(")
    callers = [p.relative_to(ROOT) for p in [*ROOT.glob("specinfer/**/*.py"), *ROOT.glob("services/**/*.py")]
               if pattern.search(p.read_text())]
    assert sorted(map(str, callers)) == ["specinfer/engine/llm_engine.py", "specinfer/engine/loop.py"]


def test_the_command_line_and_the_stack_supervisor_load_no_torch():
    """Every command builds the whole parser, and `specinfer up`'s supervising process lives as long
    as its stack: torch (about a quarter of a GB resident) stays out of both."""
    code = ("import sys\n"
            "from specinfer.cli.main import build_parser\n"
            "from specinfer.cli.launcher import _check_exec\n"
            "args = build_parser().parse_args(['up', '--llm', 'x'])\n"
            "_check_exec(args)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_one_drafter():
    """Trees are built in batches in one place: every pool host (in process, co-located, the
    speculator service) asks the `Drafter`, which alone calls the speculator's `propose`."""
    pattern = re.compile(r"\.propose\(")
    callers = [p.relative_to(ROOT) for p in [*ROOT.glob("specinfer/**/*.py"), *ROOT.glob("services/**/*.py")]
               if pattern.search(p.read_text()) and p.name != "speculator.py"]
    assert sorted(map(str, callers)) == ["specinfer/engine/drafting/drafter.py"]
