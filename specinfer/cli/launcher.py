"""`specinfer up`: the whole stack on one machine, as separate processes on localhost.

Speculators (SSMs), the verifier (LLM) and the gateway (public API) start as child processes,
exactly as the docker-compose stack runs them, and stop together on Ctrl-C / SIGTERM. With
`--num-verifiers N`, N verifiers (each hosting its own pool, or sharing the speculator processes)
listen on consecutive ports and the gateway routes between them. Every
port is checked before anything starts; the stack is up once each service answers with this
stack's instance id (not merely something on its port). A child that exits on its own is
restarted with backoff while the others keep serving, except one that cannot bind its port: that
stops the stack. The internal hops (gateway -> verifier -> speculators) require a random token made for this stack,
handed to the children in their environment; the gateway's public API stays open on localhost.
While the demo's draft builds in the background, the stack serves without it, and once it is built
moves onto it without a restart or a dropped request (`VerifierSwap`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.errors import EXIT_CANNOT_BIND, UserError
from specinfer.limits import (
    DEFAULT_DTYPE, DEFAULT_IS_PREFIX_CACHING, DEFAULT_SSM_DTYPE, DRAFT_WATCH_INTERVAL_S, GATEWAY_PORT, HTTP_PORT,
    LAUNCHER_GRACE_S, PAPER_TREE_WIDTH, SPECULATOR_PORT, VERIFIER_PORT, parse_tree_width,
)
from specinfer.pool.demo_pretrained import BackgroundDraftWatch, BuildYielder
from specinfer.serving.settings import bind_problem, reconnect_options
from specinfer.serving.shared_flags import add_declared, up_flags
from specinfer.util import CACHE_DIR_ENV, CHILD_PYTHON_ENV
from specinfer.cli.client import GatewayClient, GatewayError, print_text
from specinfer.engine.runtime.exec_config import ExecConfig


@dataclass(frozen=True)
class StackConfig:
    llm: Path
    ssms: tuple[Path, ...]
    host: str = "127.0.0.1"
    gateway_port: int = GATEWAY_PORT
    http_port: int = HTTP_PORT  # the gateway's OpenAI-compatible HTTP API; 0 = off
    verifier_port: int = VERIFIER_PORT  # the first verifier's; the next ones follow
    num_verifiers: int = 1  # verifier processes, each with the whole LLM; the gateway routes between them
    speculator_base_port: int = SPECULATOR_PORT
    num_speculators: int = 1
    redis_url: str | None = None
    dtype: str = DEFAULT_DTYPE
    ssm_dtype: str | None = DEFAULT_SSM_DTYPE  # auto: the fastest here; None: `dtype`; never changes the output
    cache_dir: Path | None = None  # the children's cache directory (load-time measurements); None: their default
    model_free: tuple[str, ...] = ()  # model-free pool members (lookup, suffix), next to the SSMs
    suffix_cache_tokens: int | None = None  # recent outputs the suffix member shares (None: the services' default)
    is_co_located: bool = False  # the verifier hosts the pool itself: no speculator process, no hop
    # each verifier also has a standby port the gateway watches, where a verifier with a new pool
    # starts before the old one drains (`VerifierSwap`: the demo's draft, once built in the background)
    has_standby_ports: bool = False
    tree_width: str = ",".join(map(str, PAPER_TREE_WIDTH))
    metrics_base_port: int = 0
    verifier_threads: int = 0  # torch threads per model process; 0 = torch's default
    tensor_parallel: int = 1  # processes the verifier shards the LLM over (it spawns them)
    attention: str = "auto"  # the models' attention backend (engine.config.ExecConfig)
    cuda_graphs: bool | None = None  # None: on wherever it can be
    is_offloaded: bool = False  # the LLM's layer weights streamed from host memory
    speculator_threads: int = 0  # 0 = `default_speculator_threads()`
    speculator_pipeline: tuple[bool, ...] = ()  # per speculator: draft ahead or not (empty: their default)
    omp_wait_policy: str | None = None  # None: leave OpenMP's default (spinning waits)
    admission_latency_factor: float | None = None  # the gateway's (0 = a fixed limit); None: its default
    is_prefix_caching: bool = DEFAULT_IS_PREFIX_CACHING  # the verifier shares full prompt blocks across requests
    kv_budget: tuple[int, int] = (0, 0)  # each verifier's KV cache: (tokens, bytes); (0, 0): sized from free memory
    kv_memory_fraction: float | None = None  # the free memory's share a sized cache takes (None: the verifiers' default)
    chat_template: Path | None = None  # the gateway's --chat-template: a Jinja file overriding the LLM's
    otlp_endpoint: str | None = None
    startup_timeout_s: float = 300.0
    # a child that exits is restarted after restart_backoff_s, doubling up to max_restart_backoff_s,
    # back to restart_backoff_s once a run of it lasted stable_after_s
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    stable_after_s: float = 60.0


@dataclass(frozen=True)
class PortUse:
    """One port the stack listens on, and the `specinfer up` flag that moves it."""

    port: int
    service: str  # the child's name: gateway, verifier, speculator-0, ...
    what: str  # "gRPC API", "HTTP API", "metrics endpoint"
    flag: str

    def describe(self, host: str) -> str:
        return f"{host}:{self.port} (the {self.service}'s {self.what}, set by {self.flag})"


def planned_ports(cfg: StackConfig) -> list[PortUse]:
    """Every port `Stack.start` makes its children listen on."""
    uses = [PortUse(cfg.gateway_port, "gateway", "gRPC API", "--gateway-port")]
    if cfg.http_port:
        uses.append(PortUse(cfg.http_port, "gateway", "HTTP API", "--http-port"))
    uses += [PortUse(cfg.verifier_port + i, verifier_name(cfg, i), "gRPC API",
                     "--verifier-port" + (f" (the first verifier's; verifier-{i} takes it + {i})" if i else ""))
             for i in range(cfg.num_verifiers)]
    num_speculators = 0 if cfg.is_co_located else cfg.num_speculators
    uses += [PortUse(cfg.speculator_base_port + i, f"speculator-{i}", "gRPC API",
                     "--speculator-port" + (f" (the first speculator's; speculator-{i} takes it + {i})" if i else ""))
             for i in range(num_speculators)]
    if cfg.has_standby_ports:
        uses += [PortUse(standby_port(cfg, i), f"{verifier_name(cfg, i)} (standby)", "gRPC API",
                         f"--verifier-port (+ {cfg.num_verifiers + i}: where a verifier with the demo draft takes over)")
                 for i in range(cfg.num_verifiers)]
    if cfg.metrics_base_port:
        uses.append(PortUse(cfg.metrics_base_port, "gateway", "metrics endpoint", "--metrics-port"))
        uses += [PortUse(cfg.metrics_base_port + 1 + i, verifier_name(cfg, i), "metrics endpoint",
                         f"--metrics-port (+ {1 + i})") for i in range(cfg.num_verifiers)]
        first = cfg.metrics_base_port + 1 + cfg.num_verifiers
        uses += [PortUse(first + i, f"speculator-{i}", "metrics endpoint",
                         f"--metrics-port (+ {first + i - cfg.metrics_base_port})") for i in range(num_speculators)]
        if cfg.has_standby_ports:
            uses += [PortUse(standby_metrics_port(cfg, i), f"{verifier_name(cfg, i)} (standby)", "metrics endpoint",
                             f"--metrics-port (+ {standby_metrics_port(cfg, i) - cfg.metrics_base_port})")
                     for i in range(cfg.num_verifiers)]
    return uses


def verifier_ports(cfg: StackConfig, index: int, is_standby: bool = False) -> tuple[int, int]:
    """Verifier `index`'s (gRPC, metrics) ports: its own, or its standby pair."""
    if is_standby:
        return standby_port(cfg, index), standby_metrics_port(cfg, index)
    return cfg.verifier_port + index, cfg.metrics_base_port + 1 + index


def standby_port(cfg: StackConfig, index: int) -> int:
    """Verifier `index`'s standby port: after every verifier's own."""
    return cfg.verifier_port + cfg.num_verifiers + index


def standby_metrics_port(cfg: StackConfig, index: int) -> int:
    """Its standby metrics port: after every other metrics port."""
    num_speculators = 0 if cfg.is_co_located else cfg.num_speculators
    return cfg.metrics_base_port + 1 + cfg.num_verifiers + num_speculators + index


def verifier_name(cfg: StackConfig, index: int) -> str:
    """The child's name: `verifier` when there is one, else verifier-0, verifier-1, ..."""
    return "verifier" if cfg.num_verifiers == 1 else f"verifier-{index}"


def default_verifier_threads(num_verifiers: int) -> int:
    """Torch threads per verifier: torch's default (every core) for one; several share the cores."""
    return 0 if num_verifiers <= 1 else max(1, (os.cpu_count() or 1) // num_verifiers)


def is_port_free(host: str, port: int) -> bool:
    return bind_problem(host, port) is None


def check_ports(cfg: StackConfig, moved_by: str | None = None) -> None:
    """UserError (exit code 2) naming the first port that is out of range, used twice or held by
    another process, and the flag that moves it (`moved_by`: one flag that moves them all); before
    any child starts."""
    seen: dict[int, PortUse] = {}
    for use in planned_ports(cfg):
        if not 1 <= use.port <= 65535:
            raise UserError(f"{use.flag}: port {use.port} is not in [1, 65535] ({use.service}'s {use.what})")
        if use.port in seen:
            raise UserError(f"port {use.port} is given twice: to {seen[use.port].describe(cfg.host)} and to "
                            f"{use.describe(cfg.host)}; move one")
        seen[use.port] = use
    for use in seen.values():
        if not is_port_free(cfg.host, use.port):
            raise UserError(f"port {use.port} is taken: {use.describe(cfg.host)} is held by another process "
                            f"(another stack?); stop it, or move this stack's with {moved_by or use.flag.split()[0]}")


class StackFailed(RuntimeError):
    """The stack cannot run: one line for the user, and the exit code of `specinfer up`."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def default_speculator_threads(num_speculators: int) -> int:
    """Torch threads per speculator on a shared machine: an eighth of the CPUs between them, at
    least one. SSMs are small, and OpenMP teams of co-located processes fight for cores: on 2 CPUs,
    a 2-thread speculator made each demo tree step 2-3x slower than a 1-thread one."""
    return max(1, (os.cpu_count() or 1) // (8 * max(1, num_speculators)))


class Child:
    """One supervised child process: its command, and when it is to be restarted."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], backoff_s: float):
        self.name, self.cmd, self.port, self.env = name, cmd, port, env
        self.backoff_s = backoff_s  # the wait before its next restart
        self.num_restarts = 0
        self.restart_at: float | None = None  # set while it is down
        self.is_supervised = True  # restarted when it exits (not while it is tried out, nor once retired)
        self.proc = self._launch()
        self.started_at = time.monotonic()

    def _launch(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=sys.stderr, stderr=sys.stderr)

    def supervise(self, now: float, cfg: StackConfig) -> None:
        """Restarts it when it has exited and its backoff has passed; logs one line per exit."""
        if self.restart_at is None:
            if self.proc.poll() is None:
                if now - self.started_at >= cfg.stable_after_s:
                    self.backoff_s = cfg.restart_backoff_s
                return
            self.restart_at = now + self.backoff_s
            print(f"specinfer: {self.name} exited with code {self.proc.returncode}; "
                  f"restarting it in {self.backoff_s:g}s", file=sys.stderr, flush=True)
            self.backoff_s = min(2 * self.backoff_s, cfg.max_restart_backoff_s)
        elif now >= self.restart_at:
            self.proc = self._launch()
            self.started_at, self.restart_at = now, None
            self.num_restarts += 1


class Stack:
    """Child processes of one local stack."""

    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.verifiers: list[Child | None] = []  # each verifier's child, by index
        self.common_env: dict[str, str] = {}
        self.spec_targets: list[str] = []
        # each child answers health checks for this name too: what tells ours from another process
        self.instance_id = secrets.token_hex(8)

    def add(self, name: str, cmd: list[str], port: int, env: dict[str, str]) -> Child:
        """Starts a child; `supervise` keeps it running."""
        child = Child(name, cmd, port, env, self.cfg.restart_backoff_s)
        self.children.append(child)
        return child

    def _spawn(self, name: str, module: str, args: list[str], port: int, env: dict[str, str]) -> Child:
        return self.add(name, [sys.executable, "-m", module, *args], port, env)

    def start(self) -> None:
        common_env = self.common_env = self._common_env()
        speculators = self.spec_targets = self._start_speculators(common_env)
        verifiers = self._start_verifiers(common_env, speculators)
        if self.cfg.has_standby_ports:
            verifiers += [f"{self.cfg.host}:{standby_port(self.cfg, i)}" for i in range(self.cfg.num_verifiers)]
        self._start_gateway(common_env, verifiers)

    def _common_env(self) -> dict[str, str]:
        """Every child's environment."""
        cfg = self.cfg
        # the internal token: in the environment, never on a command line (visible to `ps`); the gateway
        # logs warnings only (it logs every request at info), the model services tell their start-up too
        common_env = {"SPECINFER_LOG_LEVEL": "warning", "SPECINFER_AUTH_TOKEN": secrets.token_urlsafe(32),
                      "SPECINFER_AUTH_TOKEN_FILE": "", "SPECINFER_INSTANCE_ID": self.instance_id,
                      "SPECINFER_GRACE_S": str(LAUNCHER_GRACE_S),  # what `stop` waits for them
                      "SPECINFER_PARENT_PID": str(os.getpid()),  # they stop with this process, however it ends
                      **CHILD_PYTHON_ENV}
        if cfg.omp_wait_policy:
            common_env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy
        if cfg.otlp_endpoint:
            common_env["SPECINFER_OTLP_ENDPOINT"] = cfg.otlp_endpoint
        if cfg.cache_dir:
            common_env[CACHE_DIR_ENV] = str(cfg.cache_dir)
        if cfg.suffix_cache_tokens is not None:
            common_env["SPECINFER_SUFFIX_CACHE_TOKENS"] = str(cfg.suffix_cache_tokens)
        if not cfg.is_prefix_caching:
            common_env["SPECINFER_PREFIX_CACHING"] = "off"
        return common_env

    def _start_speculators(self, common_env: dict[str, str]) -> list[str]:
        """Spawns the speculators (none when the verifiers host the pool); their addresses."""
        cfg = self.cfg
        spec_targets = []
        groups = [] if cfg.is_co_located else _split(cfg.ssms, cfg.num_speculators)
        for i, group in enumerate(groups):
            port = cfg.speculator_base_port + i
            members = group + (cfg.model_free if i == 0 else ())  # the model-free members in one speculator
            args = [a for ssm in members for a in ("--ssm", str(ssm))] + ["--model-free", "off"]
            args += ["--host", cfg.host, "--port", str(port), "--dtype", cfg.ssm_dtype or cfg.dtype,
                     "--threads", str(cfg.speculator_threads or default_speculator_threads(cfg.num_speculators))]
            args += _exec_args(cfg)
            if cfg.speculator_pipeline:
                args += ["--pipeline", "on" if cfg.speculator_pipeline[i] else "off"]
            env = dict(common_env, SPECINFER_LOG_LEVEL="info")
            if cfg.metrics_base_port:
                env["SPECINFER_METRICS_PORT"] = str(cfg.metrics_base_port + 1 + cfg.num_verifiers + i)
            self._spawn(f"speculator-{i}", "services.speculator", args, port, env)
            spec_targets.append(f"{cfg.host}:{port}")
        return spec_targets

    def _start_verifiers(self, common_env: dict[str, str], spec_targets: list[str]) -> list[str]:
        """Spawns the verifiers, each with every speculator; their addresses."""
        cfg = self.cfg
        args = self.verifier_args(cfg, spec_targets)
        verifier_targets = []
        for i in range(cfg.num_verifiers):
            port, metrics_port = verifier_ports(cfg, i)
            self.verifiers.append(self.spawn_verifier(i, args, port, metrics_port))
            verifier_targets.append(f"{cfg.host}:{port}")
        return verifier_targets

    def spawn_verifier(self, index: int, args: list[str], port: int, metrics_port: int) -> Child | None:
        env = dict(self.common_env, SPECINFER_LOG_LEVEL="info")
        if self.cfg.metrics_base_port:
            env["SPECINFER_METRICS_PORT"] = str(metrics_port)
        return self._spawn(verifier_name(self.cfg, index), "services.verifier", args + ["--port", str(port)], port, env)

    @staticmethod
    def verifier_args(cfg: StackConfig, spec_targets: list[str]) -> list[str]:
        """A verifier's command-line arguments, but its port."""
        threads = cfg.verifier_threads or default_verifier_threads(cfg.num_verifiers)
        args = ["--model", str(cfg.llm), "--host", cfg.host, "--dtype", cfg.dtype,
                "--tree-width", cfg.tree_width, "--threads", str(threads)]
        args += [a for t in spec_targets for a in ("--speculator", t)]
        if cfg.is_co_located:
            pool = tuple(map(str, cfg.ssms)) + cfg.model_free
            args += [a for entry in pool or ("none",) for a in ("--ssm", entry)] + ["--model-free", "off"]
            args += ["--ssm-dtype", cfg.ssm_dtype or cfg.dtype]
        if cfg.tensor_parallel > 1:
            args += ["--tensor-parallel", str(cfg.tensor_parallel)]
        return args + _exec_args(cfg) + (["--offload", "on"] if cfg.is_offloaded else []) + _kv_args(cfg)

    def _start_gateway(self, common_env: dict[str, str], verifier_targets: list[str]) -> None:
        cfg = self.cfg
        env = dict(common_env, SPECINFER_GATEWAY_HOST=cfg.host, SPECINFER_GATEWAY_PORT=str(cfg.gateway_port),
                   SPECINFER_HTTP_PORT=str(cfg.http_port),
                   SPECINFER_VERIFIER_ADDR=",".join(verifier_targets), SPECINFER_MODEL_DIR=str(cfg.llm))
        if cfg.redis_url:
            env["SPECINFER_REDIS_URL"] = cfg.redis_url
        if cfg.admission_latency_factor is not None:
            env["SPECINFER_ADMISSION_LATENCY_FACTOR"] = str(cfg.admission_latency_factor)
        if cfg.chat_template is not None:
            env["SPECINFER_CHAT_TEMPLATE"] = str(Path(cfg.chat_template).resolve())
        if cfg.metrics_base_port:
            env["SPECINFER_METRICS_PORT"] = str(cfg.metrics_base_port)
        self._spawn("gateway", "services.gateway", [], cfg.gateway_port, env)

    def wait_healthy(self) -> None:
        """Returns once every child answers health checks as SERVING under this stack's instance id.
        StackFailed when a child exits first (a port it cannot bind: exit code 2), when another
        process answers on a child's port (exit code 2), or at the start-up timeout."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        channels = {id(c): grpc.insecure_channel(f"{self.cfg.host}:{c.port}", options=reconnect_options())
                    for c in self.children}
        pending = list(self.children)
        try:
            while pending:
                for child in self.children:  # any child that exits stops the start-up
                    code = child.proc.poll()
                    if code == EXIT_CANNOT_BIND:
                        raise self.bind_failure(child)
                    if code is not None:
                        raise StackFailed(f"{child.name} exited with code {code} during start-up (its log is above)")
                for child in list(pending):
                    if self.is_serving(child, channels[id(child)]):
                        pending.remove(child)
                if pending and time.monotonic() > deadline:
                    raise StackFailed(f"{pending[0].name} did not become healthy within "
                                      f"{self.cfg.startup_timeout_s:.0f}s")
                if pending:
                    time.sleep(0.3)
        finally:
            for channel in channels.values():
                channel.close()

    def is_serving(self, child: Child, channel: grpc.Channel) -> bool:
        """Whether the child answers its health check as SERVING under this stack's instance id;
        StackFailed (exit code 2) where another process answers on its port."""
        from specinfer.serving.grpc_server import instance_health_name  # the servers' stack: not at CLI start-up

        request = health_pb2.HealthCheckRequest(service=instance_health_name(self.instance_id))
        try:
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=1.0).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # a server that does not know our id
                raise self.stranger(child) from None
            return False

    def _uses(self, child: Child) -> list[PortUse]:
        return [u for u in planned_ports(self.cfg) if u.service == child.name] or \
            [PortUse(child.port, child.name, "gRPC API", "its port flag")]

    def bind_failure(self, child: Child) -> StackFailed:
        """The failure of a child that exited because a port of its was taken (code 2 for `up`)."""
        host = self.cfg.host
        taken = [u for u in self._uses(child) if not is_port_free(host, u.port)] or self._uses(child)
        ports = " or ".join(u.describe(host) for u in taken)
        flags = " / ".join(dict.fromkeys(u.flag.split()[0] for u in taken))
        return StackFailed(f"the {child.name} cannot bind {ports}: another process holds it; stop it, "
                           f"or move this stack's with {flags}", 2)

    def stranger(self, child: Child) -> StackFailed:
        uses = self._uses(child)
        use = next((u for u in uses if u.port == child.port), replace(uses[0], port=child.port))
        return StackFailed(f"another process answers on {use.describe(self.cfg.host)}, not this stack's "
                           f"{child.name} (it does not know this stack's instance id); stop it, or move this "
                           f"stack's with {use.flag.split()[0]}", 2)

    def stop(self, grace_s: float = LAUNCHER_GRACE_S) -> None:
        """SIGTERM to every child, and a kill for one still running after `grace_s` (their own
        grace setting: they drain within it)."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()

    def supervise(self) -> None:
        """Restarts, with backoff, every child that exited; the others keep serving (the verifier
        decodes without speculation while a speculator is down; the gateway sends requests to the
        other verifiers while one is, moving its running requests there, and answers UNAVAILABLE
        while none serves). A child that could not bind its port is StackFailed instead."""
        now = time.monotonic()
        for child in self.children:
            if not child.is_supervised:  # tried out or retired by a `VerifierSwap`, which watches it
                continue
            if child.restart_at is None and child.proc.poll() == EXIT_CANNOT_BIND:  # restarting will not free it
                raise self.bind_failure(child)
            child.supervise(now, self.cfg)


class VerifierSwap:
    """Moves a running stack's verifiers onto a new pool (the demo's draft, once its background
    build is done), one at a time and without dropping a request. A verifier with the new pool
    starts on the old one's standby port, which the gateway watches from the start; once it serves
    (the gateway routes to it as soon as its health says so), the old one drains: it takes no new
    request, finishes those it runs, and hands over any that would outlast its grace, which the
    gateway continues on the new one exactly where they were (`specinfer.serving.drain`). One that
    does not start leaves the old one serving. `step` is called from the supervising loop."""

    def __init__(self, stack: Stack, ssms: tuple[Path, ...], clock=time.monotonic):
        cfg = stack.cfg
        if not (cfg.has_standby_ports and cfg.is_co_located):
            raise ValueError("a swap needs standby ports and verifiers that host their pool")
        self.stack, self.clock = stack, clock
        self.args = Stack.verifier_args(replace(cfg, ssms=tuple(ssms)), stack.spec_targets)
        self.queue = list(range(len(stack.verifiers)))
        self.new: Child | None = None  # the verifier starting, or the one taking over
        self.old: Child | None = None  # the verifier draining
        self.deadline = 0.0
        self.channel: grpc.Channel | None = None

    def _ports(self, index: int) -> tuple[int, int]:
        """The (gRPC, metrics) ports verifier `index` moves to: the pair its present child does not use."""
        cfg = self.stack.cfg
        is_on_own = self.stack.verifiers[index].port == verifier_ports(cfg, index)[0]
        return verifier_ports(cfg, index, is_standby=is_on_own)

    def step(self) -> str | None:
        """Advances the swap; a line for the user when it is over (done, or given up), else None."""
        stack = self.stack
        if self.old is not None:  # draining
            if self.old.proc.poll() is None and self.clock() < self.deadline:
                return None
            _kill(self.old)
            stack.children.remove(self.old)
            self.old = None
        if self.new is None:
            if not self.queue:
                return "the stack now speculates with the demo draft too; the verifier without it drained and stopped"
            index = self.queue[0]
            port, metrics_port = self._ports(index)
            self.new = stack.spawn_verifier(index, self.args, port, metrics_port)
            self.new.is_supervised = False
            self.channel = grpc.insecure_channel(f"{stack.cfg.host}:{port}", options=reconnect_options())
            self.deadline = self.clock() + stack.cfg.startup_timeout_s
            return None
        try:
            is_serving = self.new.proc.poll() is None and stack.is_serving(self.new, self.channel)
        except StackFailed:
            return self._give_up("another process answers on its port")
        if not is_serving:
            if self.new.proc.poll() is not None:
                return self._give_up(f"it exited with code {self.new.proc.returncode} (its log is above)")
            if self.clock() >= self.deadline:
                return self._give_up(f"it did not serve within {stack.cfg.startup_timeout_s:.0f}s")
            return None
        index = self.queue.pop(0)
        self.old, stack.verifiers[index] = stack.verifiers[index], self.new
        self.new.is_supervised, self.old.is_supervised = True, False  # the old one is not restarted once it exits
        self.new = None
        self._close()
        if self.old.proc.poll() is None:
            self.old.proc.send_signal(signal.SIGTERM)  # it drains: finishes or hands over what it runs
        self.deadline = self.clock() + LAUNCHER_GRACE_S + 5.0
        return None

    def _close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _give_up(self, why: str) -> str:
        new, self.new, self.queue = self.new, None, []
        self._close()
        _kill(new)
        self.stack.children.remove(new)
        return f"the verifier with the demo draft did not start: {why}; the stack goes on serving without it"


def _kill(child: Child) -> None:
    """Kills the child if it still runs, and reaps it."""
    if child.proc.poll() is None:
        child.proc.kill()
        child.proc.wait()


def _split(items: tuple[Path, ...], num_groups: int) -> list[tuple[Path, ...]]:
    """Spreads SSMs over speculators round-robin; with more speculators than SSMs, each hosts all."""
    if num_groups <= len(items):
        return [tuple(items[i::num_groups]) for i in range(num_groups)]
    return [items] * num_groups


def _kv_args(cfg: StackConfig) -> list[str]:
    """The verifiers' KV-cache flags (their defaults: none)."""
    tokens, num_bytes = cfg.kv_budget
    args = ["--kv-budget", f"{tokens}" if tokens else f"{num_bytes}B"] if tokens or num_bytes else []
    return args + (["--kv-memory-fraction", f"{cfg.kv_memory_fraction:g}"] if cfg.kv_memory_fraction else [])


def _exec_args(cfg: StackConfig) -> list[str]:
    graphs = [] if cfg.cuda_graphs is None else ["--cuda-graphs", "on" if cfg.cuda_graphs else "off"]
    return ["--attention", cfg.attention] + graphs


def add_up_parser(sub) -> None:
    up = sub.add_parser("up", help="start speculator(s), verifier and gateway on localhost")
    add_declared(up, *up_flags())


def run_up(args: argparse.Namespace, cache_dir: Path) -> int:
    from specinfer.cli.commands import check_models, is_no_pool, resolve_paths  # tokenizers: not at CLI start-up

    parse_tree_width(args.tree_width)
    if args.num_verifiers < 1:
        raise UserError(f"--num-verifiers must be >= 1, got {args.num_verifiers}")
    if args.num_speculators < 0:
        raise UserError("--num-speculators must be >= 0 (0 = the verifier hosts the SSMs itself)")
    if args.co_located and args.num_speculators:
        raise UserError("--co-located hosts the SSMs in the verifier: leave out --num-speculators")
    if not 0 <= args.http_port <= 65535:
        raise UserError(f"--http-port must be in [0, 65535] (0 = off), got {args.http_port}")
    if args.once and not args.prompt:
        raise UserError("--once needs --prompt")
    is_co_located = args.co_located or not args.num_speculators
    ports = StackConfig(llm=Path(), ssms=(), gateway_port=args.gateway_port, http_port=args.http_port,
                        verifier_port=args.verifier_port, num_verifiers=args.num_verifiers,
                        speculator_base_port=args.speculator_port,
                        num_speculators=max(1, args.num_speculators), is_co_located=is_co_located,
                        metrics_base_port=args.metrics_port)
    check_ports(ports)  # before the demo models are built (minutes) or any process starts
    chat_template = args.chat_template
    if chat_template is not None:  # before any model is built or process starts
        from specinfer.chat_template import ChatTemplate  # jinja2 and numpy: not at CLI start-up

        ChatTemplate.from_file(chat_template, None, "--chat-template")
    _check_exec(args)  # before any model is built or process starts
    paths, _ = resolve_paths(args, cache_dir, ssm_needed_by="the stack", is_draft_awaited=False)
    llm_cfg, _ = check_models(paths)
    if args.tensor_parallel != 1:  # one rank always divides the model
        from specinfer.engine.runtime.parallel import check_divisible  # torch, kept out of this supervisor

        check_divisible(llm_cfg, args.tensor_parallel)  # before any process starts
    # the demo's draft builds in the background: the user hears when it is done, and the stack moves onto it
    is_draft_building = args.llm is None and not paths.ssms and not is_no_pool(args.ssm)
    cfg = StackConfig(
        llm=paths.llm, ssms=paths.ssms, model_free=paths.model_free, has_standby_ports=is_draft_building,
        is_co_located=args.co_located or not args.num_speculators or not paths.ssms, gateway_port=args.gateway_port,
        http_port=args.http_port, verifier_port=args.verifier_port, num_verifiers=args.num_verifiers,
        speculator_base_port=args.speculator_port, num_speculators=max(1, args.num_speculators),
        redis_url=args.redis_url, dtype=args.dtype, ssm_dtype=args.ssm_dtype,
        cache_dir=cache_dir,
        tree_width=args.tree_width, metrics_base_port=args.metrics_port, tensor_parallel=args.tensor_parallel,
        attention=args.attention, cuda_graphs=args.cuda_graphs, is_offloaded=args.offload,
        otlp_endpoint=args.otlp_endpoint, chat_template=chat_template,
        is_prefix_caching=args.prefix_caching, kv_budget=args.kv_budget, kv_memory_fraction=args.kv_memory_fraction,
    )
    prompt = prompt_text(args.prompt, paths.llm, chat_template, args.raw) if args.prompt else None
    watch, swap = None, None
    stop_yielding, yielding, yielder = threading.Event(), None, None  # the build waits while the stack serves
    if is_draft_building:
        watch = BackgroundDraftWatch(cache_dir)
        yielder = BuildYielder(cache_dir, log=lambda message: print(f"specinfer: {message}", file=sys.stderr, flush=True))
        yielding = threading.Thread(target=yielder.run, args=(stop_yielding,), name="draft-build-yielder", daemon=True)
    check_ports(cfg)  # again: the ports may have been taken while the models were built
    stack = Stack(cfg)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Ctrl-C stops the stack even where SIGINT came in ignored (a job a script put in the background)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if yielding is not None:  # from the services' start: loading and calibrating want the CPUs too
            yielding.start()
        stack.start()
        stack.wait_healthy()
        target = f"{cfg.host}:{cfg.gateway_port}"
        http = f", OpenAI-compatible API at http://{cfg.host}:{cfg.http_port}/v1" if cfg.http_port else ""
        print(f"specinfer: stack is up; gateway at {target}{http} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        if args.prompt:
            if yielder is not None:  # the build waits from the first token, not from the first sample
                yielder.hold()
            try:
                _answer(target, prompt, args.max_tokens, args.json)
            finally:
                if yielder is not None:
                    yielder.let_go()
            if args.once:
                return 0
        next_watch = 0.0
        while not stopping:
            stack.supervise()
            if watch is not None and time.monotonic() >= next_watch:
                next_watch = time.monotonic() + DRAFT_WATCH_INTERVAL_S
                message = watch.poll()
                if message and watch.draft is not None:
                    swap = VerifierSwap(stack, (watch.draft,))
                    message += "; a verifier with it starts beside the one serving, which then hands over to it"
                if message:
                    print(f"specinfer: {message}", file=sys.stderr, flush=True)
            message = swap.step() if swap is not None else None
            if message:
                swap = None
                print(f"specinfer: {message}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except StackFailed as exc:
        print(f"specinfer: error: {exc}; stopping the stack", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 0
    finally:
        stop_yielding.set()  # the build goes on at full speed once the stack stops
        if yielding is not None and yielding.is_alive():
            yielding.join(timeout=5.0)
        if stack.children:
            try:
                stack.stop()
            except KeyboardInterrupt:  # a second Ctrl-C while draining: no more grace, but no process left behind
                stack.stop(grace_s=0)
            print("specinfer: stack stopped", file=sys.stderr, flush=True)


def _check_exec(args: argparse.Namespace) -> None:
    """Explicit execution flags the device cannot honour fail before any process starts. Only
    those can fail (the defaults fall back to what the device supports), so torch, which this
    supervising process does not otherwise need, is imported only for them."""
    from specinfer.cli.commands import exec_config  # tokenizers: not at CLI start-up

    chosen = exec_config(args)
    if chosen == ExecConfig():
        return
    from specinfer.engine.runtime.backend import resolve_exec  # torch: only for explicit flags (see above)
    from specinfer.engine.runtime.load import resolve_device  # tokenizers: not at CLI start-up

    resolve_exec(chosen, resolve_device("auto"), args.tensor_parallel > 1)


def prompt_text(prompt: str, llm: Path, chat_template: Path | None, is_raw: bool) -> str:
    """What `up --prompt` sends: the prompt as one user message in the chat template the gateway
    uses (its --chat-template, else the model's), or as it is with `--raw` or a model without one."""
    from specinfer.chat_template import ChatRenderer, ChatTemplate  # jinja2 and numpy: not at CLI start-up

    if is_raw:
        return prompt
    template = ChatTemplate.from_file(chat_template, llm) if chat_template else ChatTemplate.from_dir(llm)
    if template is None:
        print("specinfer: the model has no chat template: --prompt goes as plain text", file=sys.stderr, flush=True)
        return prompt
    return ChatRenderer(template).render([{"role": "user", "content": prompt}])


def _answer(target: str, prompt: str, max_tokens: int, is_json: bool) -> None:
    """The reply to `up --prompt`: its text as it comes and a line of statistics, or one JSON object."""
    try:
        with GatewayClient(target, timeout_s=300) as client:
            if is_json:
                print(json.dumps(_as_dict(client.generate(prompt, max_tokens=max_tokens))), flush=True)
            else:
                print_text(client.generate_stream(prompt, max_tokens=max_tokens), sys.stdout)
    except GatewayError as exc:
        raise StackFailed(f"the prompt failed: {exc.code.name}: {exc.details}") from None


def _as_dict(reply) -> dict:
    if isinstance(reply, dict):
        return reply
    return asdict(reply) if is_dataclass(reply) else {"reply": str(reply)}
