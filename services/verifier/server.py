"""Verifier service: hosts the LLM, drives the speculate/verify loop, streams verified tokens.

SpecInfer Section 4: every step, the speculators' token trees are merged and verified in one LLM
forward pass with a topology-aware mask, and the accepted path plus one bonus token come out.
Many requests' trees share that pass (verifier worker). Multi-turn sessions keep their KV
prefix. A lost speculator degrades the request to incremental decoding, with the same greedy
output; nothing hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from services.verifier.config import VerifierConfig, parse_config
from services.verifier.speculators import SpeculationDriver, SpeculatorLink, speculator_stub
from specinfer.engine.llm_engine import GenerationResult, Verifier, check_request, speculation_depth
from specinfer.errors import UserError
from specinfer.engine.guard import SpeculationGuard
from specinfer.engine.policy import CostModel, LoadAwarePolicy
from specinfer.engine.sampling import make_generator
from specinfer.serving.convert import sampling_from_proto, sampling_to_proto, shape_from_proto, shape_to_proto
from specinfer.serving.grpc_server import RunningServer, remaining_timeout, serve_until_signalled, start_model_server
from specinfer.serving.metrics import ModelMetrics, SpecDecodeMetrics, new_registry
from specinfer.serving.tracing import outgoing_metadata, server_span, setup_tracing
from specinfer.engine.scheduler import SchedulerConfig, VerifierWorker
from specinfer.params import TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
POLL_S = 0.05
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, cfg: VerifierConfig, worker: VerifierWorker, tracer, metrics: SpecDecodeMetrics,
                 policy: LoadAwarePolicy | None = None):
        self.cfg = cfg
        self.worker = worker
        self.tracer = tracer
        self.metrics = metrics
        self.policy = policy  # None: every request speculates with its (or the default) fixed shape
        self.guard = SpeculationGuard() if policy else None  # measured check on the policy's choices
        runner = worker.runner
        self.vocab_size = runner.cfg.vocab_size
        self.max_context = runner.max_context
        self.default_shape = TreeShape(cfg.tree_width, cfg.max_tree_nodes)
        self.speculators = [(target, speculator_stub(target)) for target in cfg.speculators]
        self._hosted: dict[str, tuple[str, ...]] = {}
        self.eos = tuple(runner.cfg.eos_token_ids)

    def hosted_names(self, target: str, stub) -> tuple[str, ...] | None:
        """The SSMs a speculator hosts (asked once, then cached); None while it cannot be asked."""
        if target not in self._hosted:
            try:
                self._hosted[target] = tuple(stub.Info(pb.InfoRequest(), timeout=1.0).ssm_names)
            except grpc.RpcError:
                return None
        return self._hosted[target]

    def _speculators_for(self, ssm_names: list[str]) -> list[tuple[str, object]]:
        """The speculators serving a request's SSM pool (all of them for the default pool)."""
        if not ssm_names:
            return self.speculators
        chosen, hosted_all = [], set()
        for target, stub in self.speculators:
            hosted = self.hosted_names(target, stub)
            if hosted is None or set(hosted) & set(ssm_names):
                chosen.append((target, stub))
            hosted_all |= set(hosted or ())
        unknown = [n for n in ssm_names if n not in hosted_all]
        if unknown and all(self.hosted_names(t, s) is not None for t, s in self.speculators):
            raise UserError(f"ssm_names: no speculator hosts {', '.join(unknown)}")
        return chosen

    def Info(self, request, context):
        names = []
        for target, stub in self.speculators:
            names += list(self.hosted_names(target, stub) or ())  # one that is down adds no names
        return pb.VerifierInfo(
            model=self.cfg.model_dir.name, vocab_size=self.vocab_size, max_context=self.max_context,
            default_shape=shape_to_proto(self.default_shape), num_speculators=len(self.speculators),
            kv_capacity_tokens=self.worker.runner.kv.num_slots, ssm_names=names,
        )

    def ReleaseSession(self, request, context):
        return pb.ReleaseSessionResponse(released=self.worker.release_session(request.session_id))

    def Generate(self, request, context):
        prompt_ids = list(request.prompt_ids)
        max_new = int(request.max_new_tokens)
        check_request(prompt_ids, max_new, self.vocab_size, self.max_context)
        params = sampling_from_proto(request.sampling)
        shape = shape_from_proto(request.shape, self.default_shape)
        stops = frozenset([] if request.ignore_eos else (list(request.stop_token_ids) or self.eos))
        if any(not 0 <= t < self.vocab_size for t in stops):
            raise UserError("stop_token_ids: token id outside the vocabulary")
        timeout_s = remaining_timeout(context, self.cfg.default_deadline_s)
        deadline = time.monotonic() + timeout_s
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        with server_span(self.tracer, "verifier.generate", context, request_id=request.request_id,
                         session_id=request.session_id, prompt_tokens=len(prompt_ids)) as span:
            speculators = self._speculators_for(list(request.ssm_names)) if request.speculate else []
            # Worst case: the prompt, every new token, and the merged trees of all speculators.
            num_slots = len(prompt_ids) + max_new + 1 + shape.max_nodes * len(speculators)
            session = self.worker.open(prompt_ids, request.session_id or None, num_slots, timeout_s)
            span.set_attribute("reused_prefix_tokens", session.num_reused)
            result = GenerationResult(prompt_ids, [], 0)
            driver = None
            is_ok = False
            try:
                driver, choice = self._driver(request, params, shape, speculators, prompt_ids, max_new, timeout_s)
                verify_gen = make_generator(params.seed, 2)
                fell_back = False
                measured = None  # (ticket, tokens, start) of the previous step, for the guard
                while True:
                    step_started = time.perf_counter()
                    if measured is not None:
                        self.guard.observe(measured[0], measured[1], step_started - measured[2])
                    ticket, choice.ticket = choice.ticket, None
                    root = session.state.pending[-1]
                    step = result.num_llm_steps
                    with self.tracer.start_as_current_span("verifier.speculate") as s:
                        started = time.perf_counter()
                        tree, failed, depth = driver.tree(root)
                        if self.policy and depth and driver.is_steady:  # a stream's opening is no step cost
                            self.policy.observe_speculation(depth, time.perf_counter() - started)
                        s.set_attribute("step", step)
                        s.set_attribute("tree_nodes", len(tree))
                        for name in failed:
                            fell_back = True
                            self.metrics.fallbacks.inc()
                            span.add_event("speculator_fallback", {"speculator": name})
                    with self.tracer.start_as_current_span("verifier.verify_tree") as s:
                        future = self.worker.verify(session, tree, params, verify_gen)
                        accepted, bonus = self._wait(future, cancelled, deadline)
                        s.set_attribute("step", step)
                        s.set_attribute("tree_nodes", len(tree))
                        s.set_attribute("accepted_length", len(accepted))
                        s.set_attribute("batch_size", session.last_batch_size)
                    if self.policy:
                        self.policy.observe_step(tree, tree.find_path(accepted), params.is_greedy)
                    kept = result.record_step(accepted, bonus, len(tree), max_new, stops)
                    # The first step's time includes the prompt's prefill: not a speculation step.
                    measured = (ticket, len(accepted) + 1, step_started) if ticket and step else None
                    self.metrics.observe_step(len(tree), len(accepted), is_speculated=len(tree) > 1)
                    self.metrics.output_tokens.inc(len(kept))
                    is_done = result.is_finished(max_new)
                    if not is_done:
                        budget = speculation_depth(max_new - len(result.output_ids),
                                                   len(prompt_ids) + len(result.output_ids), self.max_context)
                        driver.after_step(accepted + [bonus], driver.plan(budget, self.worker.num_open))
                    response = pb.VerifierGenerateResponse(token_ids=kept)
                    if is_done:
                        response.finish_reason = result.finish_reason
                        response.stats.CopyFrom(self._stats(result, fell_back))
                    yield response
                    if is_done:
                        is_ok = True
                        result.latency_s = timeout_s - (deadline - time.monotonic())
                        self.metrics.time_per_output_token.observe(result.latency_s / max(1, len(result.output_ids)))
                        span.set_attribute("output_tokens", len(result.output_ids))
                        span.set_attribute("llm_steps", result.num_llm_steps)
                        return
            finally:
                if cancelled.is_set() and not is_ok:
                    span.add_event("cancelled")
                if driver is not None:
                    driver.close()
                history = prompt_ids + result.output_ids if (is_ok and request.session_id) else None
                self.worker.close(session, history)

    def _driver(self, request, params, shape, speculators, prompt_ids, max_new, timeout_s
                ) -> tuple[SpeculationDriver, "WidthChoice"]:
        """The request's speculation plan (its speculator streams open on the first tree), and
        the choice of each step's widths: load-aware, checked by the guard, or fixed."""
        is_load_aware = bool(speculators and self.policy and not request.shape.widths)
        choose = WidthChoice(self.policy if is_load_aware else None, self.guard, params.is_greedy, shape.widths)
        sampling = sampling_to_proto(params)
        metadata = outgoing_metadata()

        def open_links(start: pb.SpeculateStart) -> list[SpeculatorLink]:
            start.request_id = request.request_id
            start.sampling.CopyFrom(sampling)
            start.ssm_names.extend(request.ssm_names)
            links = [SpeculatorLink(target, stub, timeout_s) for target, stub in speculators]
            for link in links:
                link.open(start, metadata)
            return links

        driver = SpeculationDriver(open_links if speculators else None, prompt_ids, shape, choose,
                                   self.vocab_size, params.is_greedy, self.cfg.speculator_step_timeout_s)
        driver.ask(driver.plan(speculation_depth(max_new, len(prompt_ids), self.max_context), self.worker.num_open))
        return driver, choose

    @staticmethod
    def _wait(future, cancelled: threading.Event, deadline: float):
        while True:
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                if cancelled.is_set():
                    raise ConnectionAbortedError("request cancelled by the client") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("deadline exceeded while verifying") from None

    @staticmethod
    def _stats(result: GenerationResult, fell_back: bool) -> pb.GenerationStats:
        return pb.GenerationStats(**result.stats(), fell_back=fell_back)


class WidthChoice:
    """One request's widths per step: fixed, or the load-aware policy's as the guard allows.
    `ticket` is the guard's record of the latest load-aware choice (None for fixed shapes)."""

    def __init__(self, policy: LoadAwarePolicy | None, guard: SpeculationGuard | None, is_greedy: bool,
                 fixed: tuple[int, ...]):
        self.policy, self.guard, self.is_greedy, self.fixed = policy, guard, is_greedy, fixed
        self.ticket = None

    def __call__(self, batch_size: int) -> tuple[int, ...]:
        if self.policy is None:
            return self.fixed
        choose = lambda: self.policy.choose(batch_size, self.is_greedy)  # noqa: E731
        if self.guard is None:  # the policy unchecked
            return choose()
        widths, self.ticket = self.guard.plan(batch_size, choose)
        return widths


def build(cfg: VerifierConfig, exporter=None, is_worker_threaded: bool = True
          ) -> tuple[RunningServer, VerifierServicer]:
    """Loads the LLM and starts serving (used by `main` and by tests). Without a
    worker thread, the caller runs `servicer.worker.worker.run()` on this thread."""
    from specinfer.engine.load import kv_budget_tokens, resolve_device
    from specinfer.engine.config import ModelConfig
    from specinfer.engine.runner import ModelRunner

    kv_tokens = kv_budget_tokens(cfg.max_kv_tokens, cfg.kv_budget_bytes, ModelConfig.from_dir(cfg.model_dir), cfg.dtype)
    runner = ModelRunner.from_dir(cfg.model_dir, dtype=cfg.dtype, device=resolve_device(cfg.device),
                                  max_kv_tokens=kv_tokens)
    tracer = setup_tracing("specinfer-verifier", cfg.otlp_endpoint, exporter)
    registry = new_registry()
    scheduler = SchedulerConfig(max_batch=cfg.max_batch, token_budget=cfg.token_budget, max_waiting=cfg.max_waiting,
                                admission_timeout_s=cfg.admission_timeout_s, max_sessions=cfg.max_sessions)
    worker = VerifierWorker(Verifier(runner), scheduler, metrics=ModelMetrics.create(registry, "verifier"),
                            is_threaded=is_worker_threaded)
    policy = None
    if cfg.is_load_aware and cfg.speculators:
        cost = CostModel.calibrate(runner, sizes=tuple(n for n in CALIBRATION_SIZES if n <= kv_tokens // 4))
        log.info("calibrated LLM cost model: %s", ", ".join(f"{n}:{t * 1e3:.1f}ms" for n, t in cost.points))
        policy = LoadAwarePolicy(cost, max_depth=len(cfg.tree_width), max_width=max(cfg.tree_width),
                                 max_nodes=cfg.max_tree_nodes)
        worker.cost_model = cost  # refined with every measured pass
    servicer = VerifierServicer(cfg, worker, tracer, SpecDecodeMetrics.create(registry), policy)
    server = start_model_server(
        "verifier", cfg.host, cfg.port, cfg.grace_s, cfg.metrics_port, registry,
        lambda s: pb_grpc.add_VerifierServicer_to_server(servicer, s),
        pb.DESCRIPTOR.services_by_name["Verifier"].full_name, worker.worker.stop,
    )
    return server, servicer


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    def build_inline():
        server, servicer = build(cfg, is_worker_threaded=False)
        return server, servicer.worker.worker.run

    return serve_until_signalled("verifier", cfg.log_level, cfg.num_threads, build_inline)
