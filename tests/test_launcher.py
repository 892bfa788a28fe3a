"""The local launcher (`specinfer up`): which processes it starts, with which arguments."""

from __future__ import annotations

import re
import sys
import time
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


def test_each_speculator_may_be_told_whether_to_draft_ahead(monkeypatch):
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, args)))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"), Path("/m/b")), num_speculators=2,
                      speculator_pipeline=(False, True))).start()
    args = dict(spawned)
    assert [args[f"speculator-{i}"][args[f"speculator-{i}"].index("--pipeline") + 1] for i in (0, 1)] == ["off", "on"]
    spawned.clear()
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),))).start()
    assert "--pipeline" not in dict(spawned)["speculator-0"]  # the speculator's own default


def test_the_gateway_may_be_given_a_fixed_admission_limit(monkeypatch):
    """The serving benchmark compares its arms under one fixed limit: the measured one is shared by
    all arms, so a slow arm would set the limit the next arm runs under."""
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, env)))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(), admission_latency_factor=0.0)).start()
    assert dict(spawned)["gateway"]["SPECINFER_ADMISSION_LATENCY_FACTOR"] == "0.0"
    spawned.clear()
    Stack(StackConfig(llm=Path("/m/llm"), ssms=())).start()
    assert "SPECINFER_ADMISSION_LATENCY_FACTOR" not in dict(spawned)["gateway"]  # the gateway's own default


def _supervise_until(stack: Stack, predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        stack.supervise()
        time.sleep(0.01)


def test_a_child_that_exits_is_restarted_with_growing_backoff_while_the_others_keep_running(capfd):
    cfg = StackConfig(llm=Path("/m/llm"), ssms=(), restart_backoff_s=0.05, max_restart_backoff_s=0.2,
                      stable_after_s=60)
    stack = Stack(cfg)
    try:
        steady = stack.add("verifier", [sys.executable, "-c", "import time; time.sleep(60)"], 0, {})
        flaky = stack.add("speculator-0", [sys.executable, "-c", "import sys; sys.exit(3)"], 0, {})
        steady_pid = steady.proc.pid
        _supervise_until(stack, lambda: flaky.num_restarts >= 4)
        lines = [line for line in capfd.readouterr().err.splitlines() if "speculator-0 exited" in line]
        assert all("with code 3" in line for line in lines)
        delays = [float(re.search(r"restarting it in ([0-9.]+)s", line).group(1)) for line in lines]
        assert delays[:5] == [0.05, 0.1, 0.2, 0.2, 0.2][:len(delays)] and len(delays) >= 4  # doubles, capped
        assert steady.proc.poll() is None and steady.proc.pid == steady_pid and steady.num_restarts == 0
    finally:
        stack.stop(grace_s=5)
    assert steady.proc.poll() is not None  # stopping the stack stops every child


def test_backoff_resets_once_a_child_stayed_up_a_while(capfd):
    cfg = StackConfig(llm=Path("/m/llm"), ssms=(), restart_backoff_s=0.05, max_restart_backoff_s=5,
                      stable_after_s=0.1)
    stack = Stack(cfg)
    try:
        child = stack.add("gateway", [sys.executable, "-c", "import time; time.sleep(0.4)"], 0, {})
        _supervise_until(stack, lambda: child.num_restarts >= 2)
    finally:
        stack.stop(grace_s=5)
    delays = re.findall(r"gateway exited with code 0; restarting it in ([0-9.]+)s", capfd.readouterr().err)
    assert delays[:2] == ["0.05", "0.05"]  # each run lasted past stable_after_s: no growth


def test_up_hosts_the_pool_in_the_verifier_unless_asked_for_speculator_processes(monkeypatch, tiny_pair, tmp_path):
    from specinfer.cli.main import main

    started = []

    def start(self):
        started.append(self.cfg)
        raise KeyboardInterrupt  # nothing is launched: only the stack's configuration is looked at

    monkeypatch.setattr(Stack, "start", start)
    base = ["up", "--llm", str(tiny_pair.llm), "--ssm", str(tiny_pair.ssms[0]), "--cache-dir", str(tmp_path)]
    assert main(base) == 0
    assert main(base + ["--num-speculators", "2"]) == 0
    assert main(base + ["--co-located"]) == 0
    assert [(cfg.is_co_located, cfg.num_speculators) for cfg in started] == [(True, 1), (False, 2), (True, 1)]
    assert main(base + ["--co-located", "--num-speculators", "2"]) == 2
    assert main(base + ["--num-speculators", "-1"]) == 2
