"""Model workers: one thread owns a model and serves every request's steps in batches.

RPC handler threads submit jobs and wait on futures; the worker drains whatever is pending and
runs it as one batch: one SSM forward per tree level for all requests (speculator), and one LLM
forward for all requests' trees (verifier), as SpecInfer batches requests (Section 5). Domain
types only: no protobuf here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specinfer.engine import LLMState, Verifier
from specinfer.errors import CapacityError, UnavailableError
from specinfer.sampling import SamplingParams, make_generator
from specinfer.serving.metrics import ModelMetrics
from specinfer.speculator import SSMState, SSMTree, Speculator, TreeShape
from specinfer.tree import TokenTree

log = logging.getLogger(__name__)


@dataclass
class Job:
    kind: str
    args: tuple
    future: Future = field(default_factory=Future)


class BatchWorker:
    """A daemon thread that takes all pending jobs at once and hands them to `process`."""

    def __init__(self, name: str, process: Callable[[list[Job]], None], max_batch: int = 256,
                 metrics: ModelMetrics | None = None):
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._process = process
        self._metrics = metrics
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._is_stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, *args) -> Future:
        job = Job(kind, args)
        with self._lock:
            if self._is_stopped:
                job.future.set_exception(UnavailableError("model worker is shutting down"))
            else:
                self._queue.put(job)
        return job.future

    def call(self, kind: str, *args, timeout: float | None = None) -> Any:
        return self.submit(kind, *args).result(timeout=timeout)

    def stop(self) -> None:
        """Finishes the batch in progress, then fails every job not yet started."""
        with self._lock:
            self._is_stopped = True
            self._queue.put(None)
        self._thread.join(timeout=30)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and not job.future.done():
                job.future.set_exception(UnavailableError("model worker is shutting down"))

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
            start = time.perf_counter()
            try:
                self._process(jobs)
                if self._metrics is not None:
                    self._metrics.step_seconds.observe(time.perf_counter() - start)
                    self._metrics.batch_size.observe(sum(1 for j in jobs if j.kind in ("step", "verify")))
                    self._metrics.requests_waiting.set(self._queue.qsize())
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its jobs, not the worker
                log.exception("worker batch failed")
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)


# ---- speculator ------------------------------------------------------------------------------


@dataclass
class SpecSession:
    """One request's SSM-side state on this speculator."""

    states: list[SSMState | None]
    params: SamplingParams
    shape: TreeShape
    generator: torch.Generator
    last_trees: list[SSMTree | None] | None = None


class SpeculatorWorker:
    """Builds token trees for many requests at once (one batched SSM pass per tree level)."""

    def __init__(self, speculator: Speculator, max_batch: int = 256, metrics: ModelMetrics | None = None):
        self.speculator = speculator
        self.metrics = metrics
        self.num_open = 0
        self._count_lock = threading.Lock()
        if metrics is not None:
            for runner in speculator.runners:
                runner.on_forward = metrics.iteration_tokens.observe
        self.worker = BatchWorker("speculator-worker", self._process, max_batch, metrics)

    def open(self, context_ids: list[int], params: SamplingParams, shape: TreeShape,
             ssm_indices: list[int] | None = None) -> SpecSession:
        states = self.speculator.start(context_ids, ssm_indices)
        with self._count_lock:
            self.num_open += 1
        return SpecSession(states, params, shape, make_generator(params.seed, 1))

    def step(self, session: SpecSession, feedback: tuple[list[int], int] | None, max_depth: int,
             shape: TreeShape | None = None, timeout: float | None = None) -> tuple[TokenTree, float]:
        """Applies the verifier's feedback, then returns the next tree and the seconds it took."""
        return self.worker.call("step", session, feedback, max_depth, shape, timeout=timeout)

    def close(self, session: SpecSession) -> None:
        try:
            self.worker.call("close", session)
        except UnavailableError:  # shutting down: the whole cache goes with the process
            pass

    def _process(self, jobs: list[Job]) -> None:
        self._propose(jobs)
        if self.metrics is not None:
            used = sum(r.allocator.num_used for r in self.speculator.runners)
            free = sum(r.allocator.num_free for r in self.speculator.runners)
            self.metrics.observe_kv(used, free)
            self.metrics.requests_running.set(self.num_open)

    def _propose(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        proposing: list[Job] = []
        for job in jobs:
            if job.kind == "close":
                self.speculator.release(job.args[0].states)
                with self._count_lock:
                    self.num_open -= 1
                job.future.set_result(None)
                continue
            session, feedback, max_depth, shape, = job.args
            if feedback is not None:
                self.speculator.feedback(session.states, session.last_trees, *feedback)
            session.last_trees = None
            if shape is not None:
                session.shape = shape
            if max_depth > 0:
                proposing.append(job)
            else:
                root = next(s for s in session.states if s is not None).pending[-1]
                job.future.set_result((TokenTree.with_root(root), time.perf_counter() - start))
        if not proposing:
            return
        batch = [(j.args[0].states, j.args[0].shape.clipped(j.args[2]), j.args[0].params, j.args[0].generator)
                 for j in proposing]
        for job, (tree, ssm_trees) in zip(proposing, self.speculator.propose(batch)):
            job.args[0].last_trees = ssm_trees
            job.future.set_result((tree, time.perf_counter() - start))


# ---- verifier --------------------------------------------------------------------------------


@dataclass
class VerifySession:
    """One request's LLM-side state."""

    state: LLMState
    session_id: str | None
    num_reused: int = 0  # prompt tokens whose KV came from the session cache


@dataclass
class CachedSession:
    state: LLMState
    token_ids: list[int]  # tokens whose KV the cache holds, in order
    last_used: float


class VerifierWorker:
    """Verifies many requests' trees in one LLM pass; keeps multi-turn sessions' KV prefixes."""

    def __init__(self, verifier: Verifier, max_batch: int = 256, max_sessions: int = 64,
                 metrics: ModelMetrics | None = None):
        self.verifier = verifier
        self.runner = verifier.runner
        self.sessions: dict[str, CachedSession] = {}
        self.max_sessions = max_sessions
        self.metrics = metrics
        self.num_open = 0
        if metrics is not None:
            self.runner.on_forward = metrics.iteration_tokens.observe
        self.worker = BatchWorker("verifier-worker", self._process, max_batch, metrics)

    def open(self, prompt_ids: list[int], session_id: str | None) -> VerifySession:
        return self.worker.call("open", prompt_ids, session_id)

    def verify(self, session: VerifySession, tree: TokenTree, params: SamplingParams,
               generator: torch.Generator | None) -> Future:
        return self.worker.submit("verify", session, tree, params, generator)

    def close(self, session: VerifySession, history: list[int] | None) -> None:
        """Frees the request's KV, or keeps it as its session's cache when `history` is given
        (the tokens the session's conversation now holds)."""
        try:
            self.worker.call("close", session, history)
        except UnavailableError:  # shutting down: the whole cache goes with the process
            pass

    def release_session(self, session_id: str) -> bool:
        return self.worker.call("release_session", session_id)

    @property
    def num_free_blocks(self) -> int:
        return self.runner.allocator.num_free

    def _process(self, jobs: list[Job]) -> None:
        self._run(jobs)
        if self.metrics is not None:
            self.metrics.observe_kv(self.runner.allocator.num_used, self.runner.allocator.num_free)
            self.metrics.requests_running.set(self.num_open)

    def _run(self, jobs: list[Job]) -> None:
        verifies = []
        for job in jobs:
            try:
                if job.kind == "open":
                    job.future.set_result(self._open(*job.args))
                elif job.kind == "close":
                    job.future.set_result(self._close(*job.args))
                elif job.kind == "release_session":
                    job.future.set_result(self._release(job.args[0]))
                else:
                    verifies.append(job)
            except Exception as exc:  # noqa: BLE001
                job.future.set_exception(exc)
        if not verifies:
            return
        runnable = []
        for job in verifies:
            session, tree = job.args[0], job.args[1]
            if self._make_room(session.state, len(session.state.pending) + len(tree)):
                runnable.append(job)
            else:
                job.future.set_exception(CapacityError("KV cache is full"))
        if not runnable:
            return
        items = [(j.args[0].state, j.args[1], j.args[2], j.args[3]) for j in runnable]
        for job, result in zip(runnable, self.verifier.verify_batch(items)):
            job.future.set_result(result)

    def _make_room(self, state: LLMState, num_new: int) -> bool:
        """Evicts idle session caches (least recently used first) until the step fits."""
        needed = state.seq.blocks_needed(state.seq.num_committed + num_new)
        allocator = self.runner.allocator
        while needed > allocator.num_free and self.sessions:
            victim = min(self.sessions, key=lambda k: self.sessions[k].last_used)
            self._release(victim)
        return needed <= allocator.num_free

    def _open(self, prompt_ids: list[int], session_id: str | None) -> VerifySession:
        self.num_open += 1
        cached = self.sessions.pop(session_id, None) if session_id else None
        if cached is None:
            return VerifySession(self.verifier.start(prompt_ids), session_id)
        common = 0
        limit = min(len(cached.token_ids), len(prompt_ids) - 1)  # keep >= 1 pending token (the root)
        while common < limit and cached.token_ids[common] == prompt_ids[common]:
            common += 1
        state = cached.state
        state.seq.num_committed = common
        state.pending = list(prompt_ids[common:])
        state.seq.trim(common + 1)
        return VerifySession(state, session_id, num_reused=common)

    def _close(self, session: VerifySession, history: list[int] | None) -> None:
        self.num_open -= 1
        state = session.state
        if history is None or not session.session_id:
            self.verifier.release(state)
            return
        # The cache holds the committed prefix; the newest token is still pending.
        num = min(state.seq.num_committed, len(history))
        state.seq.num_committed = num
        state.seq.trim(num)
        old = self.sessions.pop(session.session_id, None)
        if old is not None:
            self.verifier.release(old.state)
        self.sessions[session.session_id] = CachedSession(state, list(history[:num]), time.monotonic())
        while len(self.sessions) > self.max_sessions:
            self._release(min(self.sessions, key=lambda k: self.sessions[k].last_used))

    def _release(self, session_id: str) -> bool:
        cached = self.sessions.pop(session_id, None)
        if cached is None:
            return False
        self.verifier.release(cached.state)
        return True
