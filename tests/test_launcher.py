"""The local launcher (`specinfer up`): which processes it starts, with which arguments."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specinfer.cli import launcher
from specinfer.cli.launcher import Stack, StackConfig, StackFailed, default_speculator_threads
from specinfer.errors import EXIT_CANNOT_BIND
from specinfer.serving.grpc_server import ServerConfig, start_server
from util import add_tokenizer, free_port, wait_until


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
    def supervised() -> bool:
        if predicate():
            return True
        stack.supervise()
        return False

    assert wait_until(supervised, timeout_s), "the supervisor did not get there in time"


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
    monkeypatch.setattr(launcher, "is_port_free", lambda host, port: True)  # whatever else runs on this machine
    base = ["up", "--llm", str(tiny_pair.llm), "--ssm", str(tiny_pair.ssms[0]), "--cache-dir", str(tmp_path)]
    assert main(base) == 0
    assert main(base + ["--num-speculators", "2"]) == 0
    assert main(base + ["--co-located"]) == 0
    assert [(cfg.is_co_located, cfg.num_speculators) for cfg in started] == [(True, 1), (False, 2), (True, 1)]
    assert main(base + ["--co-located", "--num-speculators", "2"]) == 2
    assert main(base + ["--num-speculators", "-1"]) == 2


@pytest.fixture
def held_port():
    """A port another process holds (listening), as another stack's would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("flag", ["--gateway-port", "--http-port", "--verifier-port", "--metrics-port"])
def test_a_taken_port_stops_up_before_anything_starts(monkeypatch, capsys, tmp_path, held_port, flag):
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, *args: spawned.append(args))
    ports = {name: str(free_port()) for name in ("--gateway-port", "--http-port", "--verifier-port")}
    ports[flag] = str(held_port)
    argv = ["up", "--llm", str(tmp_path / "not-built-yet"), "--cache-dir", str(tmp_path)]
    argv += [a for item in ports.items() for a in item]
    if flag == "--metrics-port":
        argv += [flag, str(held_port)]
        argv[argv.index("--gateway-port") + 1] = str(free_port())
    from specinfer.cli.main import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert f"port {held_port} is taken" in line and flag in line, line
    assert spawned == [] and out == ""  # no child, no model built (the LLM directory does not even exist)


def test_bench_under_load_refuses_a_taken_port_before_starting_the_stack(monkeypatch, capsys, tiny_pair, tmp_path,
                                                                         held_port):
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, *args: spawned.append(args))
    from specinfer.cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def"}\n')
    argv = ["bench", "--llm", str(tiny_pair.llm), "--ssm", str(tiny_pair.ssms[0]), "--cache-dir", str(tmp_path),
            "--prompts", str(prompts), "--concurrency", "1", "--port", str(held_port - 1)]  # the verifier's: +1
    assert main(argv) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert "is taken" in line and "move this stack's with --port" in line, line  # held_port, unless a
    assert spawned == [] and out == ""                                              # neighbour is taken too


def test_a_port_given_twice_is_refused():
    port = free_port()
    with pytest.raises(launcher.UserError, match=f"port {port} is given twice.*--gateway-port.*--verifier-port"):
        launcher.check_ports(StackConfig(llm=Path(), ssms=(), gateway_port=port, verifier_port=port, http_port=0))


def test_the_stack_is_up_only_when_its_own_services_answer():
    """Something else serving health on a child's port is not the child: the stack refuses it."""
    stranger = start_server(ServerConfig(port=0, grace_s=0, instance_id="someone-else"), [], ["specinfer.v1.Verifier"])
    cfg = StackConfig(llm=Path("/m/llm"), ssms=(), verifier_port=stranger.port, startup_timeout_s=20)
    stack = Stack(cfg)
    try:
        stack.add("verifier", [sys.executable, "-c", "import time; time.sleep(60)"], stranger.port, {})
        with pytest.raises(StackFailed) as info:
            stack.wait_healthy()
        assert info.value.exit_code == 2 and "not this stack's verifier" in str(info.value)
        assert f"127.0.0.1:{stranger.port}" in str(info.value)
    finally:
        stack.stop(grace_s=5)
        stranger.stop(0)
    stack = Stack(cfg)
    ours = start_server(ServerConfig(port=0, grace_s=0, instance_id=stack.instance_id), [], ["specinfer.v1.Verifier"])
    try:
        stack.add("verifier", [sys.executable, "-c", "import time; time.sleep(60)"], ours.port, {})
        stack.wait_healthy()  # the same health service, answering for this stack's id: up
    finally:
        stack.stop(grace_s=5)
        ours.stop(0)


def test_a_child_that_cannot_bind_stops_the_stack_instead_of_restarting(held_port, capfd):
    cfg = StackConfig(llm=Path("/m/llm"), ssms=(), verifier_port=held_port, restart_backoff_s=0.01)
    stack = Stack(cfg)
    try:
        child = stack.add("verifier", [sys.executable, "-c", f"import sys; sys.exit({EXIT_CANNOT_BIND})"],
                          held_port, {})
        child.proc.wait(timeout=30)
        with pytest.raises(StackFailed) as info:
            stack.supervise()
        assert info.value.exit_code == 2
        assert f"127.0.0.1:{held_port}" in str(info.value) and "--verifier-port" in str(info.value)
        assert child.num_restarts == 0 and "restarting" not in capfd.readouterr().err
    finally:
        stack.stop(grace_s=5)


@pytest.mark.parametrize("flag, what, env", [("--port", "gRPC API", "SPECINFER_GATEWAY_PORT"),
                                             ("--http-port", "HTTP API", "SPECINFER_HTTP_PORT")])
def test_a_service_that_cannot_bind_exits_once_with_one_clear_line(tmp_path, held_port, flag, what, env):
    add_tokenizer(tmp_path, 300, ["hello world, the quick brown fox. "] * 20)
    argv = ["--model-dir", str(tmp_path), "--verifier-addr", "127.0.0.1:1", "--port", "0", flag, str(held_port)]
    proc = subprocess.run([sys.executable, "-m", "services.gateway", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SPECINFER_LOG_LEVEL": "warning"})
    assert proc.returncode == EXIT_CANNOT_BIND
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"specinfer-gateway: error: cannot bind the {what} to 127.0.0.1:{held_port}: ")
    assert f"{flag} (or {env})" in line, line


def test_a_service_drains_and_exits_once_the_process_that_started_it_is_gone(tmp_path):
    """`--parent-pid` (what `specinfer up` sets): a launcher killed outright (no chance to stop its
    children) leaves no service behind. A child of a process that is SIGKILLed is re-parented;
    the service notices and exits within seconds. Without the flag it would serve on."""
    add_tokenizer(tmp_path, 300, ["hello world, the quick brown fox. "] * 20)
    port = free_port()
    gateway = [sys.executable, "-m", "services.gateway", "--model-dir", str(tmp_path), "--verifier-addr",
               "127.0.0.1:1", "--port", str(port), "--http-port", "0", "--grace-s", "1"]
    launcher_code = ("import os, subprocess, sys, time\n"
                     f"child = subprocess.Popen({gateway!r} + ['--parent-pid', str(os.getpid())])\n"
                     "print(child.pid, flush=True)\n"
                     "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "SPECINFER_LOG_LEVEL": "warning"})
    child_pid = int(parent.stdout.readline())
    try:
        assert wait_until(lambda: _health(port), 120, interval=0.5), "the gateway did not come up"
        parent.kill()  # SIGKILL: the launcher cannot stop its child
        parent.wait(timeout=10)
        assert wait_until(lambda: not _alive(child_pid), 30, interval=0.2), "the service outlived its launcher"
    finally:
        if _alive(child_pid):
            os.kill(child_pid, 9)
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by init yet, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _health(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_several_verifiers_get_consecutive_ports_and_the_gateway_gets_them_all(monkeypatch):
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    spawned = []
    monkeypatch.setattr(Stack, "_spawn",
                        lambda self, name, module, args, port, env: spawned.append((name, module, args, port, env)))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),), is_co_located=True, verifier_port=6000,
                      num_verifiers=2, metrics_base_port=7000)).start()
    assert [(name, port) for name, _, _, port, _ in spawned] == [("verifier-0", 6000), ("verifier-1", 6001),
                                                                ("gateway", 50051)]
    by_name = {name: (args, env) for name, _, args, _, env in spawned}
    for i in (0, 1):
        args, env = by_name[f"verifier-{i}"]
        assert args[args.index("--port") + 1] == str(6000 + i) and args.count("--port") == 1
        assert args[args.index("--ssm") + 1] == "/m/a"  # each hosts its own pool
        assert args[args.index("--threads") + 1] == "4"  # they share the cores
        assert env["SPECINFER_METRICS_PORT"] == str(7001 + i)
    assert by_name["gateway"][1]["SPECINFER_VERIFIER_ADDR"] == "127.0.0.1:6000,127.0.0.1:6001"
    uses = {(u.service, u.port) for u in launcher.planned_ports(StackConfig(
        llm=Path(), ssms=(), verifier_port=6000, num_verifiers=2, num_speculators=1, metrics_base_port=7000))}
    assert {("verifier-0", 6000), ("verifier-1", 6001), ("verifier-1", 7002), ("speculator-0", 7003)} <= uses


def test_up_starts_the_verifiers_it_is_asked_for_and_checks_each_port_first(monkeypatch, tiny_pair, tmp_path,
                                                                              capsys, held_port):
    from specinfer.cli.main import main

    started = []

    def start(self):
        started.append(self.cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(Stack, "start", start)
    base = ["up", "--llm", str(tiny_pair.llm), "--ssm", str(tiny_pair.ssms[0]), "--cache-dir", str(tmp_path),
            "--gateway-port", str(_free_ports(1)), "--http-port", "0"]
    first = _free_ports(2)
    assert main(base + ["--num-verifiers", "2", "--verifier-port", str(first)]) == 0
    assert [(cfg.num_verifiers, cfg.verifier_port) for cfg in started] == [(2, first)]
    assert main(base + ["--num-verifiers", "0"]) == 2
    assert "--num-verifiers must be >= 1" in capsys.readouterr().err
    # the second verifier's port is held by another process: nothing starts, the line names it
    assert main(base + ["--num-verifiers", "2", "--verifier-port", str(held_port - 1)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"port {held_port} is taken" in line and "verifier-1" in line and "--verifier-port" in line, line
    assert len(started) == 1


def _free_ports(n: int) -> int:
    """The first of `n` consecutive ports that are free now."""
    import random

    rng = random.Random()
    while True:
        first = rng.randrange(20000, 60000)
        if all(launcher.is_port_free("127.0.0.1", first + i) for i in range(n)):
            return first


def test_up_with_two_verifiers_serves_through_both(tiny_pair, tmp_path):
    """The real thing: `specinfer up --num-verifiers 2` starts two verifier processes and the gateway
    routes over them (each answers requests)."""
    import grpc

    from specinfer.v1 import specinfer_pb2 as pb
    from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
    from util import save_text_pair

    llm, ssm = save_text_pair(tmp_path / "models", 300, ["def add(a, b):\n    return a + b\n"] * 30, hidden=32,
                            max_pos=256, seed=3, ssm_seed=4, noise=0.04)
    base = _free_ports(6)  # gateway, two verifiers, three metrics endpoints
    metrics = base + 3
    argv = [sys.executable, "-m", "specinfer.cli", "up", "--llm", str(llm), "--ssm", str(ssm), "--cache-dir", str(tmp_path),
            "--num-verifiers", "2", "--gateway-port", str(base), "--verifier-port", str(base + 1),
            "--http-port", "0", "--metrics-port", str(metrics)]
    log = tmp_path / "up.log"

    def scrape() -> str:
        import urllib.request

        return urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()

    # started with SIGINT ignored, as a script's background job is: Ctrl-C (SIGINT) still stops it
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{base}") as channel:
            stub = pb_grpc.GatewayStub(channel)

            def serves() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    stub.Generate(pb.GenerateRequest(prompt="def add", max_tokens=2), timeout=10)
                    return True
                except grpc.RpcError:
                    return False

            assert wait_until(serves, 240, interval=0.5), "the stack did not come up"
            assert wait_until(lambda: "specinfer_gateway_verifiers_serving 2.0" in scrape(), 240, interval=0.5), \
                "the second verifier did not come up"  # it may still load
            for i in range(8):  # short prompts leave no trace in the routing index: they take turns
                stub.Generate(pb.GenerateRequest(prompt=f"{i} def add", max_tokens=2), timeout=30)
        text = scrape()
        routed = {m.group(1) for m in re.finditer(r'specinfer_gateway_routed_requests_total\{[^}]*verifier="([^"]+)"',
                                                  text)}
        assert routed == {f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"}, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "specinfer: stack stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_prompt_goes_as_a_chat_message_unless_raw(tmp_path, capsys):
    from specinfer.cli.launcher import prompt_text

    chat = tmp_path / "chat"
    chat.mkdir()
    (chat / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}"}))
    assert prompt_text("Hi?", chat, None, False) == "<user>Hi?</><assistant>"
    assert prompt_text("Hi?", chat, None, True) == "Hi?"
    override = tmp_path / "t.jinja"
    override.write_text("[{{ messages[0]['content'] }}]")
    assert prompt_text("Hi?", chat, override, False) == "[Hi?]"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text("{}")
    assert prompt_text("Hi?", plain, None, False) == "Hi?"
    assert "no chat template" in capsys.readouterr().err


def test_a_second_ctrl_c_while_draining_still_stops_every_child(monkeypatch, tiny_pair, tmp_path, capsys):
    """Ctrl-C drains the stack; a second one during the drain cuts the grace short instead of
    leaving the children running."""
    from specinfer.cli.main import main

    stops = []

    def start(self):
        self.children = ["a child"]
        raise KeyboardInterrupt

    def stop(self, grace_s=15.0):
        stops.append(grace_s)
        if len(stops) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", stop)
    args = ["up", "--llm", str(tiny_pair.llm), "--ssm", str(tiny_pair.ssms[0]), "--cache-dir", str(tmp_path),
            "--gateway-port", str(_free_ports(1)), "--http-port", "0", "--verifier-port", str(_free_ports(1))]
    assert main(args) == 0
    assert len(stops) == 2 and stops[1] == 0
    assert "stack stopped" in capsys.readouterr().err


def test_a_running_stack_moves_onto_a_new_pool_without_dropping_a_request(tmp_path):
    """The demo's draft, once its background build is done, joins a stack that is serving: a
    verifier with it starts on the standby port the gateway watches, then the old one drains.
    Requests sent all along, through the swap, each succeed with the LLM's own greedy output."""
    import threading

    import grpc

    from specinfer.cli.launcher import VerifierSwap
    from specinfer.v1 import specinfer_pb2 as pb
    from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
    from util import save_text_pair

    llm, ssm = save_text_pair(tmp_path / "models", 300, ["def add(a, b):\n    return a + b\n"] * 30, hidden=32,
                            max_pos=256, seed=3, ssm_seed=4, noise=0.04)
    base = _free_ports(3)  # gateway, the verifier, its standby
    cfg = StackConfig(llm=llm, ssms=(), model_free=("lookup", "suffix"), is_co_located=True, has_standby_ports=True,
                      gateway_port=base, http_port=0, verifier_port=base + 1, cache_dir=tmp_path, verifier_threads=1,
                      startup_timeout_s=180)
    assert [u.port for u in launcher.planned_ports(cfg)] == [base, base + 1, base + 2]
    stack = Stack(cfg)
    outputs, failures, stop = [], [], threading.Event()

    def client() -> None:  # one request after another, as a user's would come
        with grpc.insecure_channel(f"127.0.0.1:{base}") as channel:
            stub = pb_grpc.GatewayStub(channel)
            while not stop.is_set():
                try:
                    reply = stub.Generate(pb.GenerateRequest(prompt="def add", max_tokens=40, ignore_eos=True),
                                          timeout=60)
                    outputs.append(tuple(reply.token_ids))
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code().name}: {exc.details()}")

    thread = threading.Thread(target=client, daemon=True)
    try:
        stack.start()
        stack.wait_healthy()
        old = stack.verifiers[0]
        with grpc.insecure_channel(f"127.0.0.1:{base}") as channel:
            stub = pb_grpc.GatewayStub(channel)

            def hosted() -> list[str] | None:  # the SSMs the serving verifiers host
                try:
                    return list(stub.Info(pb.InfoRequest(), timeout=10).ssm_names)
                except grpc.RpcError:  # none serving yet (the gateway polls their health)
                    return None

            assert wait_until(lambda: hosted() is not None, 60) and ssm.name not in hosted()
            thread.start()
            assert wait_until(lambda: len(outputs) >= 2 or failures, 120), "no request was served"
            swap = VerifierSwap(stack, (ssm,))
            message = []

            def swapped() -> bool:
                stack.supervise()
                message.append(swap.step())
                return message[-1] is not None

            assert wait_until(swapped, 240, interval=0.1), "the swap did not finish"
            assert "now speculates with the demo draft" in message[-1], message[-1]
            served_before = len(outputs)
            assert wait_until(lambda: len(outputs) >= served_before + 3 or failures, 120)
            stop.set()
            thread.join(timeout=90)
            assert old.proc.poll() is not None and old not in stack.children  # drained, not restarted
            new = stack.verifiers[0]
            assert new.port == base + 2 and new.proc.poll() is None and new.is_supervised
            assert wait_until(lambda: ssm.name in (hosted() or []), 60)
            named = stub.Generate(pb.GenerateRequest(prompt="def add", max_tokens=40, ignore_eos=True,
                                                     ssm_names=[ssm.name]), timeout=60)
        assert not failures, failures
        assert len(set(outputs)) == 1 and tuple(named.token_ids) == outputs[0]  # exact through the swap
    finally:
        stop.set()
        stack.stop(grace_s=10)


def test_a_swap_whose_verifier_does_not_start_leaves_the_old_one_serving(monkeypatch):
    stack = Stack(StackConfig(llm=Path("/m/llm"), ssms=(), is_co_located=True, has_standby_ports=True,
                              verifier_port=40001, startup_timeout_s=60))
    old = stack.add("verifier", [sys.executable, "-c", "import time; time.sleep(60)"], 40001, {})
    stack.verifiers.append(old)
    spawned = []

    def spawn(self, name, module, args, port, env):
        spawned.append((name, args, port))
        return self.add(name, [sys.executable, "-c", "import sys; sys.exit(1)"], port, env)

    monkeypatch.setattr(Stack, "_spawn", spawn)
    try:
        from specinfer.cli.launcher import VerifierSwap

        swap = VerifierSwap(stack, (Path("/m/draft"),))
        assert swap.step() is None  # spawned on the standby port
        name, args, port = spawned[0]
        assert name == "verifier" and port == 40002 and args[args.index("--ssm") + 1] == "/m/draft"
        assert wait_until(lambda: (message := swap.step()) is not None and spawned.append(message) is None, 30)
        assert "did not start: it exited with code 1" in spawned[-1] and "goes on serving without it" in spawned[-1]
        assert stack.children == [old] and stack.verifiers == [old] and old.proc.poll() is None
    finally:
        stack.stop(grace_s=5)


def test_standby_ports_follow_every_other_port_and_the_gateway_watches_them(monkeypatch):
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, port, env)))
    cfg = StackConfig(llm=Path("/m/llm"), ssms=(), is_co_located=True, has_standby_ports=True, num_verifiers=2,
                      gateway_port=41000, http_port=0, verifier_port=41001, metrics_base_port=42000)
    uses = {(u.service, u.what): u for u in launcher.planned_ports(cfg)}
    assert uses[("verifier-0 (standby)", "gRPC API")].port == 41003 and uses[("verifier-1 (standby)", "gRPC API")].port == 41004
    assert uses[("verifier-1 (standby)", "metrics endpoint")].port == 42004  # after the gateway's and the verifiers'
    assert len({u.port for u in uses.values()}) == len(uses)  # no port twice
    assert "--verifier-port" in uses[("verifier-0 (standby)", "gRPC API")].flag
    Stack(cfg).start()
    gateway_env = dict((name, env) for name, _, env in spawned)["gateway"]
    assert gateway_env["SPECINFER_VERIFIER_ADDR"].split(",") == [f"127.0.0.1:{p}" for p in (41001, 41002, 41003, 41004)]
    assert [port for name, port, _ in spawned if name.startswith("verifier")] == [41001, 41002]  # standby: none yet
    spawned.clear()
    Stack(replace(cfg, has_standby_ports=False)).start()
    assert dict((name, env) for name, _, env in spawned)["gateway"]["SPECINFER_VERIFIER_ADDR"].count(",") == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_child_pythons_import_the_installed_package_not_the_one_in_their_directory(tmp_path):
    """The stack's services and the background draft build start with `python -m` in the user's
    directory; from a source checkout installed with `pip install .`, that directory's `specinfer`
    (without the compiled CPU kernel) must not shadow the installed one."""
    from specinfer.util import CHILD_PYTHON_ENV

    decoy = tmp_path / "specinfer"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the directory copy was imported')\n")
    cmd = [sys.executable, "-c", "import specinfer"]
    shadowed = subprocess.run(cmd, cwd=tmp_path, env={**os.environ}, capture_output=True, text=True)
    assert shadowed.returncode != 0 and "the directory copy" in shadowed.stderr  # what happens without it
    safe = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **CHILD_PYTHON_ENV}, capture_output=True, text=True)
    assert safe.returncode == 0, safe.stderr
    stack = Stack(StackConfig(llm=tmp_path, ssms=()))
    assert all(stack._common_env().get(k) == v for k, v in CHILD_PYTHON_ENV.items())
