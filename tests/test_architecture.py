"""The architecture's import rules (ARCHITECTURE.md), checked statically and at import time.

- the engine imports no gRPC, protobuf, serving or CLI code;
- the gateway imports no torch and no engine;
- services import nothing from each other;
- `specinfer.serving` does not import `specinfer.cli`;
- the shared vocabulary (params, limits, stats, errors, tokenizer) imports no torch.
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


def test_the_rule_checker_has_teeth(tmp_path):
    (tmp_path / "bad.py").write_text("def f():\n    from specinfer.serving.convert import stats_to_proto\n")
    assert any("specinfer.serving" in n for n in imported_modules(tmp_path / "bad.py"))


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
