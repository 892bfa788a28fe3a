"""One way to declare a command-line option: a `Flag`, each long option once.

A scan of the product code (specinfer/, services/) fails when a long option is declared by two
`Flag(...)` calls (an on/off switch declares its `--no-` form too), when a `Flag`'s name is not
written out (it could not be checked), when a `Flag`'s default is a literal other than an empty
or zero value (defaults live in `specinfer.limits`), or when anything but the mechanism
(`specinfer/serving/settings.py`) calls `add_argument`. Then the options' variables: each
command reads the ones its declarations name, with no hand-written fallback.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MECHANISM = "specinfer/serving/settings.py"


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _keyword(call: ast.Call, name: str, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return call.args[position] if len(call.args) > position else None


def _is_literal_default(node: ast.expr | None) -> bool:
    """A number or a string written where a default is declared, other than 0 and ""."""
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool) or node.value is None:
        return False
    return isinstance(node.value, (int, float, str)) and node.value not in (0, "")


def declaration_problems(sources: dict[str, str]) -> list[str]:
    """What breaks the one-declaration rule in `sources` (path -> Python text)."""
    problems, declared = [], {}
    for path, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path}:{node.lineno}"
            if _name(node.func) == "add_argument" and path != MECHANISM:
                problems.append(f"{where} calls add_argument: declare a Flag in specinfer/serving/shared_flags.py")
            if _name(node.func) != "Flag":
                continue
            name = _keyword(node, "name", 0)
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                problems.append(f"{where} declares a Flag whose name is not written out")
                continue
            names = [name.value]
            switch = _keyword(node, "is_switch", 10)
            if isinstance(switch, ast.Constant) and switch.value is True:
                names.append("--no-" + name.value.removeprefix("--"))
            for option in names:
                if option in declared:
                    problems.append(f"{option} is declared twice: {declared[option]} and {where}")
                declared.setdefault(option, where)
            if _is_literal_default(_keyword(node, "default", 3)):
                problems.append(f"{where} gives {name.value} a literal default: name it in specinfer/limits.py")
    return problems


def product_sources() -> dict[str, str]:
    paths = [*ROOT.glob("specinfer/**/*.py"), *ROOT.glob("services/**/*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def test_every_option_is_declared_once_through_the_mechanism():
    sources = product_sources()
    assert "specinfer/serving/shared_flags.py" in sources and MECHANISM in sources
    assert declaration_problems(sources) == []


@pytest.mark.parametrize("sources, fragment", [
    ({"specinfer/a.py": 'Flag("--x", (), int, None)\n', "services/b.py": 'Flag("--x", "X", int, None)\n'},
     "--x is declared twice: services/b.py:1 and specinfer/a.py:1"),
    ({"specinfer/a.py": 'Flag(name="--y", env=(), parse=int, default=None)\nFlag("--y", (), int, None)\n'},
     "--y is declared twice"),
    ({"specinfer/a.py": 'Flag("--z", "Z", parse_bool, True, "", is_switch=True)\nFlag("--no-z", (), str, None)\n'},
     "--no-z is declared twice"),
    ({"specinfer/cli/a.py": 'p.add_argument("--w", type=int)\n'}, "specinfer/cli/a.py:1 calls add_argument"),
    ({"specinfer/a.py": 'def f(name):\n    return Flag(name, (), int, None)\n'}, "name is not written out"),
    ({"specinfer/a.py": 'Flag("--v", (), int, 128)\n'}, "--v a literal default"),
    ({"specinfer/a.py": 'Flag("--u", (), str, default="auto")\n'}, "--u a literal default"),
])
def test_the_scan_catches_what_it_should(sources, fragment):
    problems = declaration_problems(sources)
    assert any(fragment in p for p in problems), problems


def test_the_scan_passes_what_it_should():
    ok = {MECHANISM: 'p.add_argument(flag.name)\n',
          "specinfer/a.py": 'Flag("--a", (), int, LIMIT)\nFlag("--b", (), int, 0)\nFlag("--c", (), str, "")\n'
                            'Flag("--d", (), parse_bool, False, is_toggle=True)\nFlag("--e", "E", int, None)\n'}
    assert declaration_problems(ok) == []


def _parse(argv: list[str], monkeypatch, **env: str) -> argparse.Namespace:
    from specinfer.cli.main import build_parser

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args(argv)


def test_a_commands_variables_come_from_its_declarations(monkeypatch, tmp_path):
    """`up` and `client` read SPECINFER_REDIS_URL, SPECINFER_CHAT_TEMPLATE, SPECINFER_OTLP_ENDPOINT,
    SPECINFER_GATEWAY_TARGET and SPECINFER_GATEWAY_TOKEN as their declarations say; a flag wins."""
    for key in ("SPECINFER_REDIS_URL", "SPECINFER_CHAT_TEMPLATE", "SPECINFER_OTLP_ENDPOINT",
                "SPECINFER_GATEWAY_TARGET", "SPECINFER_GATEWAY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    up = _parse(["up"], monkeypatch)
    assert (up.redis_url, up.chat_template, up.otlp_endpoint, up.http_port) == (None, None, None, 8000)
    template = tmp_path / "t.jinja"
    up = _parse(["up"], monkeypatch, SPECINFER_REDIS_URL="redis://r:1/0", SPECINFER_CHAT_TEMPLATE=str(template),
                SPECINFER_OTLP_ENDPOINT="http://o:4317")
    assert (up.redis_url, up.chat_template, up.otlp_endpoint) == ("redis://r:1/0", template, "http://o:4317")
    assert _parse(["up", "--redis-url", "redis://flag:2/0"], monkeypatch).redis_url == "redis://flag:2/0"

    client = _parse(["client", "info"], monkeypatch)
    assert (client.target, client.token, client.timeout) == ("127.0.0.1:50051", None, 300.0)
    client = _parse(["client", "info"], monkeypatch, SPECINFER_GATEWAY_TARGET="gw:1", SPECINFER_GATEWAY_TOKEN="t")
    assert (client.target, client.token) == ("gw:1", "t")
    assert _parse(["client", "info", "--target", "flag:2"], monkeypatch).target == "flag:2"


def test_any_parser_reads_a_commands_options_whole(monkeypatch):
    """A caller's own argparse parser gets every default; `resolve_declared` adds the variables."""
    from specinfer.cli.client import add_client_parser
    from specinfer.pool.commands import add_pool_parsers
    from specinfer.serving.settings import resolve_declared

    monkeypatch.setenv("SPECINFER_GATEWAY_TARGET", "gw:3")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_client_parser(sub)
    add_pool_parsers(sub)
    args = parser.parse_args(["client", "generate", "--prompt", "x", "--choice", "a", "--choice", "b"])
    assert (args.temperature, args.top_p, args.stop, args.choice, args.json) == (0.0, 1.0, [], ["a", "b"], False)
    assert args.target is None and resolve_declared(args).target == "gw:3"
    assert resolve_declared(args).target == "gw:3"  # resolving again changes nothing
    tune = parser.parse_args(["boost-tune", "--llm", "l", "--ssm", "s", "--corpus", "c", "--out", "o"])
    assert (tune.temperature, tune.seed, tune.kl_top_k, tune.device, tune.exclude) == (1.0, 0, 20, "auto", [])


def test_bad_values_name_their_option():
    from specinfer.cli.main import build_parser
    from specinfer.errors import UserError

    parser = build_parser()
    with pytest.raises(UserError, match="--tensor-parallel must be > 0"):
        parser.parse_args(["generate", "--prompt", "x", "--tensor-parallel", "0"])
    with pytest.raises(UserError, match="--omp-wait-policy: invalid choice"):
        parser.parse_args(["bench", "--omp-wait-policy", "active"])
    with pytest.raises(UserError, match="not allowed with argument"):
        parser.parse_args(["generate", "--prompt", "x", "--regex", "a", "--choice", "b"])
