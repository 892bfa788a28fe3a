"""`specinfer up`: the whole stack on one machine, as separate processes on localhost.

Speculators (SSMs), the verifier (LLM) and the gateway (public API) start as child processes,
exactly as the docker-compose stack runs them, and stop together on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specinfer.errors import UserError
from specinfer.limits import PAPER_TREE_WIDTH


@dataclass(frozen=True)
class StackConfig:
    llm: Path
    ssms: tuple[Path, ...]
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    verifier_port: int = 50052
    speculator_base_port: int = 50053
    num_speculators: int = 1
    redis_url: str | None = None
    dtype: str = "float32"
    ssm_dtype: str | None = None  # the speculators' dtype (default: `dtype`); never changes the output
    tree_width: str = ",".join(map(str, PAPER_TREE_WIDTH))
    metrics_base_port: int = 0
    verifier_threads: int = 0  # torch threads per model process; 0 = torch's default
    speculator_threads: int = 0  # 0 = `default_speculator_threads()`
    omp_wait_policy: str | None = None  # None: leave OpenMP's default (spinning waits)
    otlp_endpoint: str | None = None
    startup_timeout_s: float = 300.0


def default_speculator_threads(num_speculators: int) -> int:
    """Torch threads per speculator on a shared machine: an eighth of the CPUs between them, at
    least one. SSMs are small, and OpenMP teams of co-located processes fight for cores: on 2 CPUs,
    a 2-thread speculator made each demo tree step 2-3x slower than a 1-thread one."""
    return max(1, (os.cpu_count() or 1) // (8 * max(1, num_speculators)))


class Stack:
    """Child processes of one local stack."""

    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.procs: list[tuple[str, subprocess.Popen, int]] = []

    def _spawn(self, name: str, module: str, args: list[str], port: int, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", module, *args]
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=sys.stderr, stderr=sys.stderr)
        self.procs.append((name, proc, port))

    def start(self) -> None:
        cfg = self.cfg
        common_env = {"SPECINFER_LOG_LEVEL": "warning"}
        if cfg.omp_wait_policy:
            common_env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy
        if cfg.otlp_endpoint:
            common_env["SPECINFER_OTLP_ENDPOINT"] = cfg.otlp_endpoint
        spec_targets = []
        groups = _split(cfg.ssms, cfg.num_speculators)
        for i, group in enumerate(groups):
            port = cfg.speculator_base_port + i
            args = [a for ssm in group for a in ("--ssm", str(ssm))]
            args += ["--host", cfg.host, "--port", str(port), "--dtype", cfg.ssm_dtype or cfg.dtype,
                     "--threads", str(cfg.speculator_threads or default_speculator_threads(cfg.num_speculators))]
            env = dict(common_env)
            if cfg.metrics_base_port:
                env["SPECINFER_METRICS_PORT"] = str(cfg.metrics_base_port + 2 + i)
            self._spawn(f"speculator-{i}", "services.speculator", args, port, env)
            spec_targets.append(f"{cfg.host}:{port}")
        args = ["--model", str(cfg.llm), "--host", cfg.host, "--port", str(cfg.verifier_port), "--dtype", cfg.dtype,
                "--tree-width", cfg.tree_width, "--threads", str(cfg.verifier_threads)]
        args += [a for t in spec_targets for a in ("--speculator", t)]
        env = dict(common_env)
        if cfg.metrics_base_port:
            env["SPECINFER_METRICS_PORT"] = str(cfg.metrics_base_port + 1)
        self._spawn("verifier", "services.verifier", args, cfg.verifier_port, env)
        env = dict(common_env, SPECINFER_GATEWAY_HOST=cfg.host, SPECINFER_GATEWAY_PORT=str(cfg.gateway_port),
                   SPECINFER_VERIFIER_ADDR=f"{cfg.host}:{cfg.verifier_port}", SPECINFER_MODEL_DIR=str(cfg.llm))
        if cfg.redis_url:
            env["SPECINFER_REDIS_URL"] = cfg.redis_url
        if cfg.metrics_base_port:
            env["SPECINFER_METRICS_PORT"] = str(cfg.metrics_base_port)
        self._spawn("gateway", "services.gateway", [], cfg.gateway_port, env)

    def wait_healthy(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self.cfg.startup_timeout_s
        for name, proc, port in self.procs:
            stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"{self.cfg.host}:{port}"))
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not become healthy within {self.cfg.startup_timeout_s:.0f}s")
                time.sleep(0.3)

    def stop(self, grace_s: float = 15.0) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def any_exited(self) -> str | None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                return f"{name} exited with code {proc.returncode}"
        return None


def _split(items: tuple[Path, ...], num_groups: int) -> list[tuple[Path, ...]]:
    """Spreads SSMs over speculators round-robin; with more speculators than SSMs, each hosts all."""
    if num_groups <= len(items):
        return [tuple(items[i::num_groups]) for i in range(num_groups)]
    return [items] * num_groups


def add_up_parser(sub) -> None:
    up = sub.add_parser("up", help="start speculator(s), verifier and gateway on localhost")
    up.add_argument("--llm", type=Path, help="LLM directory (default: demo models)")
    up.add_argument("--ssm", type=Path, action="append", default=[], help="SSM directory (repeatable)")
    up.add_argument("--cache-dir", type=Path)
    up.add_argument("--num-speculators", type=int, default=1)
    up.add_argument("--gateway-port", type=int, default=50051)
    up.add_argument("--verifier-port", type=int, default=50052)
    up.add_argument("--speculator-port", type=int, default=50053, help="first speculator's port")
    up.add_argument("--redis-url", default=None, help="default: SPECINFER_REDIS_URL, else an in-memory store")
    up.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    up.add_argument("--ssm-dtype", choices=["float32", "bfloat16", "float16"], help="default: --dtype")
    up.add_argument("--tree-width", default=",".join(map(str, PAPER_TREE_WIDTH)))
    up.add_argument("--metrics-port", type=int, default=0, help="gateway /metrics port; the others follow it")
    up.add_argument("--prompt", help="send this prompt through the gateway once the stack is up, print the reply")
    up.add_argument("--max-tokens", type=int, default=64)
    up.add_argument("--once", action="store_true", help="exit after answering --prompt")


def run_up(args: argparse.Namespace, cache_dir: Path) -> int:
    from specinfer.cli.commands import resolve_paths
    from specinfer.limits import parse_tree_width

    parse_tree_width(args.tree_width)
    if args.num_speculators < 1:
        raise UserError("--num-speculators must be >= 1")
    if args.once and not args.prompt:
        raise UserError("--once needs --prompt")
    paths, _ = resolve_paths(args, cache_dir, ssm_needed_by="the stack")
    from specinfer.engine.load import check_models

    check_models(paths)
    cfg = StackConfig(
        llm=paths.llm, ssms=paths.ssms, gateway_port=args.gateway_port, verifier_port=args.verifier_port,
        speculator_base_port=args.speculator_port, num_speculators=args.num_speculators,
        redis_url=args.redis_url or os.environ.get("SPECINFER_REDIS_URL"), dtype=args.dtype, ssm_dtype=args.ssm_dtype,
        tree_width=args.tree_width, metrics_base_port=args.metrics_port,
        otlp_endpoint=os.environ.get("SPECINFER_OTLP_ENDPOINT"),
    )
    stack = Stack(cfg)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        stack.start()
        stack.wait_healthy()
        target = f"{cfg.host}:{cfg.gateway_port}"
        print(f"specinfer: stack is up; gateway at {target} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        if args.prompt:
            from specinfer.cli.client import GatewayClient

            reply = GatewayClient(target, timeout_s=300).generate(args.prompt, max_tokens=args.max_tokens)
            print(json.dumps(_as_dict(reply)), flush=True)
            if args.once:
                return 0
        while not stopping:
            problem = stack.any_exited()
            if problem:
                print(f"specinfer: error: {problem}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _as_dict(reply) -> dict:
    if isinstance(reply, dict):
        return reply
    from dataclasses import asdict, is_dataclass

    return asdict(reply) if is_dataclass(reply) else {"reply": str(reply)}
