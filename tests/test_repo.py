"""Repository contracts: the README's two set-up commands, CI running the test one, and tests that
assert nothing about wall-clock time."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_has_exactly_two_setup_commands():
    commands = quick_start_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    run, test = commands
    assert "specinfer up" in run and "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start_commands()[1] in ci


def test_no_generated_stubs_are_committed():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in files if re.search(r"_pb2(_grpc)?\.pyi?$", f)]


# ---- tests assert nothing about wall-clock time ----------------------------------------------------
# Time belongs to benchmarks: a test checks behaviour, ordered by events (threading.Event, futures,
# barriers) or an injectable clock, and waits with `util.wait_until` or a generous timeout that only
# guards against a hang. The scan below finds an `assert` that reads a value derived from a clock
# reading the test took (an elapsed time, a timestamp, a deadline), following assignments, tuple
# positions, containers and attributes a reading went into, and the tests' own functions that
# return one.
CLOCK_READS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
CARRYING_BUILTINS = {"abs", "float", "int", "len", "list", "max", "min", "round", "sorted", "sum", "tuple", "zip"}
FILLING_METHODS = {"add", "append", "extend", "insert", "put"}


def _is_clock_read(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "time":
        return func.attr in CLOCK_READS
    return isinstance(func, ast.Name) and func.id in CLOCK_READS - {"time"}


class ClockTaint:
    """What in some test modules holds a clock reading: names (per module), attributes (shared)."""

    def __init__(self):
        self.names: set[str] = set()
        self.attrs: set[str] = set()
        self.functions: dict[str, bool | list[bool]] = {}  # returns a reading (per tuple position)
        self.local_functions: set[str] = set()

    def carries(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        if isinstance(node, ast.Call):
            if _is_clock_read(node):
                return True
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in self.functions:
                returned = self.functions[name]
                return returned is True or (isinstance(returned, list) and any(returned))
            args = [*node.args, *(k.value for k in node.keywords)]
            return name in CARRYING_BUILTINS | self.local_functions and any(self.carries(a) for a in args)
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Attribute):
            return node.attr in self.attrs
        if isinstance(node, ast.Subscript):
            return self.carries(node.value)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.carries(node.elt) or any(self.carries(g.iter) or any(self.carries(c) for c in g.ifs)
                                                 for g in node.generators)
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List,
                             ast.Set, ast.Starred)):
            return any(self.carries(child) for child in ast.iter_child_nodes(node))
        return False

    def mark(self, target: ast.AST) -> bool:
        """Marks what `target` names as holding a reading; True when that is news."""
        if isinstance(target, (ast.Tuple, ast.List)):
            return any([self.mark(t) for t in target.elts])
        if isinstance(target, ast.Starred):
            return self.mark(target.value)
        if isinstance(target, ast.Subscript):
            return self.mark(target.value)
        kind, name = ((self.names, target.id) if isinstance(target, ast.Name)
                      else (self.attrs, target.attr) if isinstance(target, ast.Attribute) else (None, None))
        if kind is None or name in kind:
            return False
        kind.add(name)
        return True

    def bind(self, target: ast.AST, value: ast.AST) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            positions = None
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                positions = [self.carries(v) for v in value.elts]
            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                returned = self.functions.get(value.func.id)
                positions = returned if isinstance(returned, list) and len(returned) == len(target.elts) else None
            if positions is not None:
                return any([self.mark(t) for t, p in zip(target.elts, positions) if p])
        return self.carries(value) and self.mark(target)


def _is_clock_default(value: ast.AST) -> bool:
    """`field(default_factory=time.monotonic)` and the like: a dataclass field born a reading."""
    factories = [k.value for k in getattr(value, "keywords", ()) if k.arg == "default_factory"]
    return any(isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "time"
               and f.attr in CLOCK_READS for f in factories)


def _returns(function: ast.FunctionDef, taint: ClockTaint) -> bool | list[bool]:
    values = [n.value for n in ast.walk(function) if isinstance(n, ast.Return) and n.value is not None]
    sizes = {len(v.elts) if isinstance(v, ast.Tuple) else -1 for v in values}
    if len(sizes) == 1 and -1 not in sizes:
        return [any(taint.carries(v.elts[i]) for v in values) for i in range(sizes.pop())]
    return any(taint.carries(v) for v in values)


def _spread(tree: ast.Module, taint: ClockTaint) -> bool:
    """One pass of marking what holds a reading; True when anything new was marked."""
    changed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            changed |= any([taint.bind(t, node.value) for t in node.targets])
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            if _is_clock_default(node.value) and isinstance(node.target, ast.Name):
                changed |= node.target.id not in taint.attrs
                taint.attrs.add(node.target.id)
            changed |= taint.bind(node.target, node.value)
        elif isinstance(node, (ast.For, ast.comprehension)) and taint.carries(node.iter):
            changed |= taint.mark(node.target)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FILLING_METHODS
              and isinstance(node.func.value, ast.Name) and any(taint.carries(a) for a in node.args)):
            changed |= taint.mark(node.func.value)  # a local container (an attribute's name is too common)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            returned = _returns(node, taint)
            changed |= taint.functions.get(node.name) != returned
            taint.functions[node.name] = returned
    return changed


def clock_assertions(sources: dict[str, str]) -> list[str]:
    """`file:line` of every assert that reads a clock reading taken in `sources` (name -> code)."""
    trees = {name: ast.parse(code) for name, code in sources.items()}
    attrs: set[str] = set()
    taints = {}
    for _ in range(2):  # attributes are shared between modules (a helper stores, a test reads)
        for name, tree in trees.items():
            taint = taints[name] = ClockTaint()
            taint.attrs = attrs
            taint.local_functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            while _spread(tree, taint):
                pass
    return [f"{name}:{node.lineno}" for name, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Assert) and taints[name].carries(node.test)]


def test_no_test_asserts_on_wall_clock_time():
    sources = {p.name: p.read_text() for p in sorted((ROOT / "tests").glob("*.py"))}
    assert len(sources) > 40
    assert clock_assertions(sources) == []


def test_the_clock_scan_finds_what_it_should_and_only_that():
    helper = "class Call:\n    ended_at: float = field(default_factory=time.monotonic)\n"
    timing = '''
def timed(f):
    started = time.perf_counter()
    return f(), time.perf_counter() - started

def test_it(call):
    t0 = time.monotonic()
    assert run() and time.monotonic() - t0 < 1.0          # an elapsed time
    result, waited = timed(run)
    assert result == 3                                      # fine: not the reading
    assert waited < 0.5                                     # a helper's elapsed time
    steps = []
    steps.append((time.monotonic(), 4))
    during = [n for t, n in steps if t0 < t]
    assert len(during) >= 5                                 # timestamps, filtered
    assert call.ended_at < limit                            # a helper's attribute
    deadline = time.monotonic() + 5
    assert time.monotonic() < deadline                      # a deadline read in an assert
    record = replace(rec, updated_at=time.time() - 3600)
    assert store.create(record)                             # fine: a timestamp in a record's field
    assert wait_until(lambda: done.is_set(), 10)            # fine: a bounded wait
    assert clock.now < 5                                    # fine: an injected clock
'''
    lines = [i + 1 for i, line in enumerate(timing.splitlines()) if "    assert" in line and "fine" not in line]
    assert clock_assertions({"helper.py": helper, "t.py": timing}) == [f"t.py:{n}" for n in lines]
    assert len(lines) == 5


# ---- imports inside functions ----------------------------------------------------------------------
# An import inside a function hides a module's dependencies and pays a lookup per call; product code
# keeps one only to keep something heavy or optional (torch, triton, transformers) off a light path,
# and says why on its line.
MAX_FUNCTION_IMPORTS = 40
PRODUCT = ("specinfer", "services")


def product_files(root: Path = ROOT) -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((root / folder).rglob("*.py"))
            if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def function_imports(path: Path) -> list[int]:
    """Lines of the import statements inside functions (methods and nested functions included)."""
    lines = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return sorted(lines)


def test_few_imports_inside_functions_each_with_its_reason():
    found = {p: function_imports(p) for p in product_files()}
    total = sum(len(lines) for lines in found.values())
    assert 0 < total <= MAX_FUNCTION_IMPORTS, f"{total} imports inside functions (at most {MAX_FUNCTION_IMPORTS})"
    unexplained = [f"{p.relative_to(ROOT)}:{n}" for p, lines in found.items() for n in lines
                   if "#" not in p.read_text().splitlines()[n - 1]]
    assert not unexplained, "imports inside functions without a reason on their line: " + ", ".join(unexplained)


def test_the_function_import_count_has_teeth(tmp_path):
    (tmp_path / "m.py").write_text("import os\n\n\ndef f():\n    import json\n\n    def g():\n        from a import b\n"
                                   "\n\nclass C:\n    def h(self):\n        import re\n")
    assert function_imports(tmp_path / "m.py") == [5, 8, 13]


# ---- long functions ------------------------------------------------------------------------------
# A function over 60 lines does several things: product code splits it into named steps. The few
# left are declarations read top to bottom (flag tables, `specinfer up`'s checks before it starts a
# stack) and the Triton kernel with its launcher.
MAX_LINES = 60
MAX_LONG_FUNCTIONS = 5


def long_functions(path: Path) -> list[str]:
    return [f"{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)" for fn in ast.walk(ast.parse(path.read_text()))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > MAX_LINES]


def test_few_long_functions():
    found = [f"{p.relative_to(ROOT)}: {f}" for p in product_files() for f in long_functions(p)]
    assert len(found) <= MAX_LONG_FUNCTIONS, "functions over 60 lines:\n" + "\n".join(found)


def test_the_long_function_count_has_teeth(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "m.py").write_text(f"def short():\n{body[:-len('    x59 = 59')-1]}\n\n\ndef long():\n{body}")
    assert long_functions(tmp_path / "m.py") == ["long (61 lines)"]
