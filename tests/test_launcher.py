"""The local launcher (`specinfer up`): which processes it starts, with which arguments."""

from __future__ import annotations

from pathlib import Path

from specinfer.cli import launcher
from specinfer.cli.launcher import Stack, StackConfig, default_speculator_threads


def test_speculators_get_a_small_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    assert default_speculator_threads(1) == 1
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 64)
    assert default_speculator_threads(1) == 8
    assert default_speculator_threads(4) == 2


def test_stack_spawns_each_service_with_its_threads(monkeypatch):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, args)))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"), Path("/m/b")), num_speculators=2)).start()
    names = [name for name, _ in spawned]
    assert names == ["speculator-0", "speculator-1", "verifier", "gateway"]
    args = dict(spawned)
    for name in ("speculator-0", "speculator-1"):
        assert args[name][args[name].index("--threads") + 1] == "1"
    assert args["verifier"][args["verifier"].index("--threads") + 1] == "0"  # torch's default: all cores
    assert args["verifier"].count("--speculator") == 2

    spawned.clear()
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),), speculator_threads=3)).start()
    speculator_args = dict(spawned)["speculator-0"]
    assert speculator_args[speculator_args.index("--threads") + 1] == "3"  # an explicit count wins
