"""Verifier service: hosts the LLM and streams the verified tokens of every request.

SpecInfer Section 4: each step, the speculators' token trees are merged and verified in one LLM
forward pass with a topology-aware mask, and the accepted path plus one bonus token come out.
The decode loop itself is the engine's (`specinfer.engine.loop`); this servicer converts
protobuf at the edge, opens each request's spans and streams its tokens. Many requests' trees
share one pass (the engine's scheduler, on its own thread). Multi-turn sessions keep their KV
prefix. A lost speculator degrades the request to incremental decoding, with the same greedy
output; nothing hangs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace

from opentelemetry import trace

from services.verifier.config import VerifierConfig, parse_config
from services.verifier.speculators import RemoteSpeculation, co_located_pool, pool_context
from specinfer.engine.llm_engine import Engine, EngineConfig
from specinfer.engine.loop import DraftTree, Generation
from specinfer.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from specinfer.engine.drafting.tree import TokenTree
from specinfer.limits import MODEL_DTYPES, Q8_DTYPE, check_verifier_request
from specinfer.params import TreeShape
from specinfer.errors import UnavailableError, UserError
from specinfer.logprobs import space_for
from specinfer.model_source import resolve
from specinfer.serving.convert import (
    finish_to_proto, load_to_proto, logprobs_to_proto, params_from_verifier_request, samples_from_verifier_request,
    shape_to_proto, space_to_proto, stats_to_proto,
)
from specinfer.serving.capacity import LatencyModel, TokenPace, VerifierLoad
from specinfer.serving.grpc_server import RunningServer, model_service_main, remaining_timeout, start_model_service
from specinfer.serving.metrics import ModelMetrics, SpecDecodeMetrics
from specinfer.serving.tracing import server_span
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from specinfer.engine.models.checkpoint import safetensors_files
from specinfer.engine.runtime.assemble import load_grammars, load_runner
from specinfer.engine.runtime.load import resolve_device, split_pool
from specinfer.engine.runtime.parallel import ParallelConfig, ShardSpec, serve_rank, shard_config
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.memory import Memory, device_memory, plan_kv, weight_bytes
from specinfer.engine.verification.verifier import Verifier
from specinfer.engine.runtime.runner import DEFAULT_BLOCK_SIZE
from specinfer.engine.runtime.cpu import configure_cpu_runtime
from specinfer.serving.logs import setup_logging
from specinfer.engine.runtime.backend import resolve_exec

log = logging.getLogger(__name__)


class VerifierServicer(pb_grpc.VerifierServicer):
    """The Verifier service. It measures what it serves (time per output token against the
    requests running, `specinfer.serving.capacity`) and reports it with its batch capacity and
    free KV in Info, for the gateways' admission; on SIGTERM it drains (`specinfer.serving.drain`):
    new requests are refused UNAVAILABLE (the gateway sends them to another verifier), those in
    flight finish, and one that cannot finish in time ends UNAVAILABLE where it is, so the gateway
    continues it on another verifier."""

    def __init__(self, cfg: VerifierConfig, engine: Engine, tracer, metrics: SpecDecodeMetrics):
        self.cfg = cfg
        self.engine = engine
        self.tracer = tracer
        self.metrics = metrics
        self.latency = LatencyModel()
        self.pace = TokenPace()
        self._lock = threading.Lock()
        self._active: dict[int, list[Generation] | None] = {}  # per call: its samples' generations once started
        self._handed_over: set[int] = set()
        self._is_draining = False

    def Info(self, request, context):
        engine, speculation = self.engine, self.engine.source
        return pb.VerifierInfo(
            model=self.cfg.model_dir.name, vocab_size=engine.verifier.runner.cfg.vocab_size,
            max_context=engine.max_context, default_shape=shape_to_proto(engine.cfg.default_shape),
            num_speculators=len(getattr(speculation, "speculators", ())),
            kv_capacity_tokens=engine.verifier.runner.kv.num_slots,
            ssm_names=speculation.all_names() if speculation else [],
            kv_block_size=engine.verifier.runner.allocator.block_size,
            load=load_to_proto(self.load()),
        )

    def Load(self, request, context):
        return load_to_proto(self.load())

    def load(self) -> VerifierLoad:
        """What it serves now: batch capacity, requests running and waiting, free KV, measured pace."""
        scheduler, allocator = self.engine.scheduler, self.engine.verifier.runner.allocator
        with self._lock:
            num_calls = len(self._active)
        return VerifierLoad(max_batch=scheduler.cfg.max_batch, num_running=scheduler.num_open,
                            num_waiting=max(0, num_calls - scheduler.num_open),
                            kv_capacity_tokens=self.engine.verifier.runner.kv.num_slots,
                            kv_free_tokens=allocator.num_free * allocator.block_size,
                            points=self.latency.points(), is_draining=self._is_draining)

    def ReleaseSession(self, request, context):
        return pb.ReleaseSessionResponse(released=self.engine.scheduler.release_session(request.session_id))

    def Generate(self, request, context):
        """One request's verified steps; with num_samples = n > 1, its n samples in this one call
        (`Engine.start_samples`: the prompt read once), each message naming its sample."""
        prompt_ids, params = list(request.prompt_ids), params_from_verifier_request(request)
        params.checked(self.cfg.limits)  # the deployment's limits, whoever calls: before admission
        check_verifier_request(len(prompt_ids), params.max_new_tokens, params.ssm_names, self.cfg.limits)
        progress = samples_from_verifier_request(request)
        if params.num_samples > 1 and request.session_id:  # a session's next turn continues one text
            raise UserError("num_samples: samples cannot continue a session; use num_samples = 1")
        timeout_s = remaining_timeout(context, self.cfg.default_deadline_s)
        key = self._enter()
        abandon = _abandon_when(context, time.monotonic() + timeout_s)

        def should_stop() -> None:  # also once the request was handed over (draining)
            abandon()
            self._check_handed_over(key)

        try:
            with server_span(self.tracer, "verifier.generate", context, request_id=request.request_id,
                             session_id=request.session_id, prompt_tokens=len(prompt_ids),
                             num_samples=params.num_samples) as span:
                observer = StepSpans(self.tracer, self.metrics, span)
                if params.num_samples > 1:
                    samples = self.engine.start_samples(prompt_ids, params, request.request_id, timeout_s, observer,
                                                        progress)
                else:
                    samples = [(0, self.engine.start(prompt_ids, params, request.request_id,
                                                     request.session_id or None, timeout_s, observer))]
                with self._lock:
                    self._active[key] = [g for _, g in samples]
                span.set_attribute("reused_prefix_tokens", max(g.session.num_reused for _, g in samples))
                yield from self._steps(samples, span, context, should_stop)
        finally:
            with self._lock:
                self._active.pop(key, None)
                self._handed_over.discard(key)

    def _steps(self, samples, span, context, should_stop):
        """The call's verified steps: each step of each sample one message (its samples step
        together, in one pass), timing each per output token."""
        is_ok, last_at = False, None
        live = list(samples)
        try:
            while live:
                should_stop()
                kept_all = self.engine.step([g for _, g in live], should_stop)
                now = time.monotonic()
                for kept in kept_all:
                    if kept and last_at is not None:  # from the second step: the first one also read the prompt
                        self._observe((now - last_at) / len(kept))
                last_at = now if any(kept_all) else last_at
                for (index, generation), kept in zip(list(live), kept_all):
                    if generation.is_done:
                        live.remove((index, generation))
                    if not live and generation.is_done:  # before the last message: the caller may close on it
                        is_ok = True
                        results = [g.result for _, g in samples]
                        span.set_attribute("output_tokens", sum(len(r.output_ids) for r in results))
                        span.set_attribute("llm_steps", max(r.num_llm_steps for r in results))
                    yield self._response(generation, kept, index)
                    if generation.is_done:
                        self.engine.finish(generation)  # its KV is free for the others at once
        finally:
            if not is_ok and context.is_active() is False:
                span.add_event("cancelled")
            for _, generation in samples:
                self.engine.finish(generation)

    def _observe(self, token_s: float) -> None:
        self.latency.add(max(1, self.engine.scheduler.num_open), token_s)
        self.pace.observe(token_s)

    # -- draining (specinfer.serving.drain.Drainable) -----------------------------------------
    def _enter(self) -> int:
        """Registers a call; a draining verifier takes none (the gateway goes to another)."""
        with self._lock:
            if self._is_draining:
                raise UnavailableError("the verifier is stopping; the request goes to another verifier")
            key = max(self._active, default=0) + 1
            self._active[key] = None
            return key

    def _check_handed_over(self, key: int) -> None:
        if key in self._handed_over:
            raise UnavailableError("the verifier is stopping: the request goes on on another verifier")

    def stop_taking(self) -> None:
        with self._lock:
            self._is_draining = True

    def in_flight(self) -> list[tuple[int, int]]:
        with self._lock:
            active = list(self._active.items())
        return [(key, max((g.params.max_new_tokens - len(g.result.output_ids) for g in gens), default=0)
                 if gens is not None else 0) for key, gens in active if key not in self._handed_over]

    def token_s(self) -> float | None:
        return self.pace.value

    def hand_over(self, keys: list[int]) -> None:
        with self._lock:
            self._handed_over.update(k for k in keys if k in self._active)

    def _response(self, generation, kept: list[int], index: int = 0) -> pb.VerifierGenerateResponse:
        result, num_cached = generation.result, generation.session.num_reused
        response = pb.VerifierGenerateResponse(token_ids=kept, cached_prompt_tokens=num_cached, sample_index=index)
        if generation.params.num_logprobs is not None:
            response.logprobs.extend(logprobs_to_proto(result.output_logprobs[len(result.output_ids) - len(kept):]))
            response.logprob_space = space_to_proto(space_for(generation.params.sampling.is_greedy))
        if generation.is_done:
            response.finish_reason = result.finish_reason
            response.finish = finish_to_proto(result.finish_reason)
            response.stats.CopyFrom(stats_to_proto(replace(result.stats(), cached_prompt_tokens=num_cached)))
            self.metrics.time_per_output_token.observe(result.latency_s / max(1, len(result.output_ids)))
        return response


def _abandon_when(context, deadline: float):
    """Raises, while a step waits for the LLM, once the client went away or the deadline passed."""
    cancelled = threading.Event()
    context.add_callback(cancelled.set)

    def should_stop() -> None:
        if cancelled.is_set():
            raise ConnectionAbortedError("request cancelled by the client")
        if time.monotonic() > deadline:
            raise TimeoutError("deadline exceeded while verifying")

    return should_stop


class StepSpans:
    """One request's per-step spans (`verifier.speculate`, `verifier.verify_tree`) and metrics."""

    def __init__(self, tracer, metrics: SpecDecodeMetrics, request_span):
        self.tracer, self.metrics, self.request_span = tracer, metrics, request_span
        self._parent = trace.set_span_in_context(request_span)

    def _span(self, name: str, started: float, ended: float, **attributes) -> None:
        offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)
        span = self.tracer.start_span(name, context=self._parent, start_time=offset_ns + int(started * 1e9),
                                      attributes=attributes)
        span.end(end_time=offset_ns + int(ended * 1e9))

    def speculated(self, step: int, draft: DraftTree, started: float, ended: float) -> None:
        late = {"late_speculators": ",".join(draft.late)} if draft.late else {}
        self._span("verifier.speculate", started, ended, step=step, tree_nodes=len(draft.tree), **late)
        for name in draft.failed:
            self.metrics.fallbacks.inc()
            self.request_span.add_event("speculator_fallback", {"speculator": name})
        if draft.late:
            self.metrics.late_trees.inc(len(draft.late))

    def verified(self, step: int, tree: TokenTree, accepted: list[int], kept: list[int], batch_size: int,
                 started: float, ended: float) -> None:
        self._span("verifier.verify_tree", started, ended, step=step, tree_nodes=len(tree),
                   accepted_length=len(accepted), batch_size=batch_size)
        self.metrics.observe_step(len(tree), len(accepted), is_speculated=len(tree) > 1)
        self.metrics.output_tokens.inc(len(kept))


def build(cfg: VerifierConfig, exporter=None, is_worker_threaded: bool = True
          ) -> tuple[RunningServer, VerifierServicer]:
    """Loads the LLM and starts serving (used by `main` and by tests). Without a worker thread,
    the caller runs `server.run_worker()` on this thread."""
    resolve(cfg.model_dir, cfg.cache_dir)  # a GGUF's metadata files under this service's cache directory
    parallel = cfg.parallel or (ParallelConfig.spawned(cfg.tensor_parallel) if cfg.tensor_parallel > 1 else None)
    plan = kv_plan(cfg, parallel.num_ranks if parallel else 1)
    source = resolve(cfg.model_dir)
    if not source.is_gguf:  # no weights (or pickle only) is a one-line error, before any log line
        safetensors_files(source.path)
    log.info("loading the LLM %s (%s)", cfg.model_dir, cfg.dtype)
    started = time.perf_counter()
    runner = load_runner(cfg.model_dir, dtype=cfg.dtype, device=resolve_device(cfg.device), max_kv_tokens=plan.num_tokens,
                         parallel=parallel, exec_cfg=cfg.execution)
    log.info("LLM loaded in %.1fs; %s", time.perf_counter() - started, plan.describe())
    try:
        server, servicer = _serve(cfg, runner, exporter, is_worker_threaded)
    except BaseException:
        runner.close()
        raise
    leader = getattr(runner.model, "leader", None)
    if leader is not None:  # a rank that dies takes the whole service down
        leader.on_broken(lambda reason: _take_down(server, reason))
    return server, servicer


def kv_plan(cfg: VerifierConfig, num_ranks: int = 1):
    """The LLM's KV cache (`memory.plan_kv`), per device: with tensor parallelism each rank holds
    1/N of the KV heads, and every rank sizes alike, from its device's total memory (its share of
    the host's RAM on a CPU), so that all hold the same number of slots. Co-located SSMs hold as
    many slots: their caches count too."""
    llm_cfg = ModelConfig.from_dir(cfg.model_dir)
    device = resolve_device(cfg.device)
    ssm_dtype = cfg.ssm_dtype if cfg.ssm_dtype in MODEL_DTYPES else cfg.dtype  # auto: at most the LLM's size
    ssm_dirs = split_pool(cfg.co_located, is_model_free=False)[0]
    models = [(shard_config(llm_cfg, num_ranks), cfg.dtype)] + [(ModelConfig.from_dir(d), ssm_dtype) for d in ssm_dirs]
    context = llm_cfg.max_context
    request_tokens = min(context, cfg.limits.max_prompt_tokens + cfg.limits.max_new_tokens) + cfg.max_tree_nodes
    memory = weights = None
    if cfg.kv_budget == (0, 0):
        memory = device_memory(device)
        if num_ranks > 1:
            share = memory.total_bytes // (1 if device.startswith("cuda") else num_ranks)
            memory = Memory(share, share, f"{memory.where} (one rank's share of the total)")
        else:  # the weights as they will be held (a GGUF's block codes stay codes on a CPU); a
            # tensor-parallel rank's shard is counted from its config
            ssm_weights = cfg.ssm_dtype if cfg.ssm_dtype == Q8_DTYPE else ssm_dtype
            weights = weight_bytes(cfg.model_dir, cfg.dtype, device) + sum(
                weight_bytes(d, ssm_weights, device) for d in ssm_dirs)
    return plan_kv(models, device, cfg.kv_budget, cfg.kv_memory_fraction, request_tokens, cfg.max_batch, memory,
                   weights)


def _take_down(server: RunningServer, reason: str) -> None:
    """NOT_SERVING at once; drain and stop on another thread (this may be the model's own)."""
    log.error("the LLM's tensor-parallel group is down (%s): stopping", reason)
    server.set_serving(False)
    threading.Thread(target=server.stop, name="tp-take-down", daemon=True).start()


def _serve(cfg: VerifierConfig, runner, exporter, is_worker_threaded: bool) -> tuple[RunningServer, VerifierServicer]:
    speculation = (RemoteSpeculation(cfg.speculators, runner.cfg.vocab_size, cfg.speculator_step_timeout_s,
                                     cfg.max_message_bytes, cfg.speculator_security)
                   if cfg.speculators else co_located_pool(cfg.co_located, runner, cfg.ssm_dtype,
                                                                   resolve_device(cfg.device), cfg.execution,
                                                                   prefer=cfg.dtype, cache_dir=cfg.cache_dir,
                                                                   suffix_cache_tokens=cfg.suffix_cache_tokens))
    engine_cfg = EngineConfig(default_shape=TreeShape(cfg.tree_width, cfg.max_tree_nodes),
                              is_load_aware=cfg.is_load_aware, is_guarded=True,
                              scheduler=SchedulerConfig(max_batch=cfg.max_batch, token_budget=cfg.token_budget,
                                                        max_waiting=cfg.max_waiting, max_sessions=cfg.max_sessions,
                                                        is_prefix_caching=cfg.is_prefix_caching,
                                                        admission_timeout_s=cfg.admission_timeout_s))

    def create(tracer, registry):
        scheduler = Scheduler(Verifier(runner), engine_cfg.scheduler, ModelMetrics.create(registry, "verifier"),
                              is_threaded=is_worker_threaded)
        engine = Engine(runner, speculation, engine_cfg, scheduler, max_context=pool_context(speculation, runner),
                        grammars=load_grammars(cfg.model_dir, runner.cfg))
        if speculation and cfg.is_load_aware:  # calibrate the cost model now, not on the first request
            engine.calibrate(cfg.cache_dir)
            engine.policy()
        return VerifierServicer(cfg, engine, tracer, SpecDecodeMetrics.create(registry)), scheduler

    server, servicer = start_model_service("verifier", cfg, exporter, create, pb_grpc.add_VerifierServicer_to_server,
                                           pb.DESCRIPTOR.services_by_name["Verifier"].full_name)
    server.work = servicer  # SIGTERM: its requests finish, or are handed over
    return server, servicer


def main(argv: list[str] | None = None) -> int:
    """Serves the LLM. Under a launcher (torchrun), ranks > 0 of a tensor-parallel group run no
    server: they load their shard and follow rank 0's steps until it stops."""
    if int(os.environ.get("RANK", "0")) > 0:
        return _serve_rank(argv)
    built: list[VerifierServicer] = []

    def build_kept(cfg: VerifierConfig, **kwargs) -> tuple[RunningServer, VerifierServicer]:
        server, servicer = build(cfg, **kwargs)
        built.append(servicer)
        leader = getattr(servicer.engine.verifier.runner.model, "leader", None)
        if leader is not None:  # a rank stuck in a collective with a dead peer never returns: leave anyway
            leader.on_broken(lambda _: _exit_after(cfg.grace_s + 10))
        return server, servicer

    code = model_service_main("verifier", argv, parse_config, build_kept)
    if not built:
        return code
    runner = built[0].engine.verifier.runner
    leader = getattr(runner.model, "leader", None)
    runner.close()
    return 1 if leader is not None and leader.broken else code


def _exit_after(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, (1,))
    timer.daemon = True
    timer.start()


def _serve_rank(argv: list[str] | None) -> int:
    configure_cpu_runtime()
    try:
        cfg = parse_config(argv)
        setup_logging("verifier", cfg.log_level)
        kv_tokens = kv_plan(cfg, cfg.parallel.num_ranks).num_tokens  # as rank 0 sizes it
        num_slots = -(-kv_tokens // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
        device = resolve_device(cfg.device)
        attention = resolve_exec(cfg.execution, device, is_parallel=True).attention  # as rank 0 resolves it
        serve_rank(ShardSpec(str(cfg.model_dir), cfg.dtype, device, num_slots, attention), cfg.parallel)
    except UserError as exc:
        print(f"specinfer-verifier: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # rank 0 went away or a step failed here: the launcher takes the group down
        log.error("tensor-parallel rank %s stops: %s: %s", os.environ.get("RANK"), type(exc).__name__, exc)
        return 1
    return 0
