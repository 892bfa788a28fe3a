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
from typing import Any, Callable, Protocol


from specinfer.engine.drafting.drafter import Ask, Drafter
from specinfer.engine.drafting.speculator import DraftSession, Speculator
from specinfer.engine.drafting.tree import TokenTree
from specinfer.errors import UnavailableError
from specinfer.limits import DEFAULT_MAX_BATCH
from specinfer.params import SamplingParams, TreeBudget, TreeShape

log = logging.getLogger(__name__)


class WorkerMetrics(Protocol):
    """The model metrics a worker updates (Prometheus collectors in the services)."""

    step_seconds: Any
    batch_size: Any
    requests_waiting: Any
    requests_running: Any
    iteration_tokens: Any

    def observe_kv(self, num_used: int, num_free: int) -> None: ...

    def observe_prefix_cache(self, num_queried: int, num_hit: int) -> None: ...


@dataclass
class Job:
    kind: str
    args: tuple
    future: Future = field(default_factory=Future)


IDLE_POLL_S = 0.05
_NO_JOB = Job("none", ())


class BatchWorker:
    """A daemon thread that takes all pending jobs at once and hands them to `process`.

    `process` may return (jobs to carry into the next iteration, whether it did work): a
    prompt read in chunks, or a request waiting for KV memory, stays in the worker's hands.
    """

    def __init__(self, name: str, process: Callable[[list[Job]], None], max_batch: int = DEFAULT_MAX_BATCH,
                 metrics: WorkerMetrics | None = None, is_threaded: bool = True, is_inline: bool = False):
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._process = process
        self._metrics = metrics
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._is_stopped = False
        self._done = threading.Event()
        self._carried: list[Job] = []
        self._is_busy = False
        # Who runs the iterations: a thread of its own (`is_threaded`), the thread that calls
        # `run()` (a service's main thread, which loaded the model), or, `is_inline`, whoever
        # waits for a result (`pump`: the in-process engine, on one thread).
        self.is_threaded = is_threaded
        self.is_inline = is_inline and not is_threaded
        if is_threaded:
            threading.Thread(target=self.run, name=name, daemon=True).start()

    @property
    def has_waiting(self) -> bool:
        """Whether jobs are queued for the next iteration."""
        return not self._queue.empty()

    def submit(self, kind: str, *args) -> Future:
        job = Job(kind, args)
        with self._lock:
            if self._is_stopped:
                job.future.set_exception(UnavailableError("model worker is shutting down"))
            else:
                self._queue.put(job)
        return job.future

    def call(self, kind: str, *args, timeout: float | None = None) -> Any:
        future = self.submit(kind, *args)
        if self.is_inline:
            self.pump([future])
        return future.result(timeout=timeout)

    def pump(self, futures: list[Future]) -> None:
        """Runs iterations on the calling thread until every future is done (inline workers only:
        elsewhere, model passes belong to the worker's own thread)."""
        if not self.is_inline:
            raise RuntimeError("only an inline worker is pumped by its callers")
        while not all(f.done() for f in futures):
            if self._iterate(block=False) is None:
                return

    def stop(self) -> None:
        """Finishes the batch in progress, then fails every job not yet started."""
        with self._lock:
            self._is_stopped = True
            self._queue.put(None)
        if self.is_threaded:
            self._done.wait(timeout=30)
        self._fail(self._carried, UnavailableError("model worker is shutting down"))
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.future.done():
                job.future.set_exception(UnavailableError("model worker is shutting down"))
        if not self.is_threaded:
            self._queue.put(None)  # the caller's `run()` may still be waiting for the end signal

    def run(self) -> None:
        """The worker loop, until `stop`. Call it on the thread that loaded the model when the
        worker is not threaded: with OpenMP, a model is markedly slower (here 15 vs 20 ms per
        LLM pass) on a thread other than the one that first ran it."""
        try:
            while self._iterate(block=True) is not None:
                pass
        finally:
            self._done.set()

    def _iterate(self, block: bool) -> bool | None:
        """Takes every pending job (plus those carried over) and processes them once; None once
        stopped. Blocks for work only when `block` and nothing carried over can make progress."""
        carried = self._carried
        try:
            timeout = None if not carried else (0 if self._is_busy else IDLE_POLL_S)
            job = self._queue.get(timeout=timeout) if block else self._queue.get_nowait()
        except queue.Empty:
            job = _NO_JOB
        if job is None:
            self._fail(carried, UnavailableError("model worker is shutting down"))
            self._carried = []
            return None
        jobs = carried + ([] if job is _NO_JOB else [job])
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
            self._carried, self._is_busy = self._process(jobs) or ([], False)
            if self._metrics is not None and self._is_busy:
                self._metrics.step_seconds.observe(time.perf_counter() - start)
                self._metrics.batch_size.observe(sum(1 for j in jobs if j.kind in ("step", "verify")))
                self._metrics.requests_waiting.set(self._queue.qsize() + len(self._carried))
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its jobs, not the worker
            log.exception("worker batch failed")
            self._fail(jobs, exc)
            self._carried, self._is_busy = [], False
        return self._is_busy

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        for j in jobs:
            if not j.future.done():
                j.future.set_exception(exc)


# ---- speculator ------------------------------------------------------------------------------


class SpeculatorWorker:
    """The speculator service's model thread: the trees its requests ask for, built in batches by
    one `Drafter` (one batched SSM pass per tree level)."""

    def __init__(self, speculator: Speculator, max_batch: int = DEFAULT_MAX_BATCH, metrics: WorkerMetrics | None = None,
                 is_threaded: bool = True, is_pipelined: bool = False):
        on_ahead = None if metrics is None else (lambda outcome: metrics.ahead_trees.labels("speculator", outcome).inc())
        # Pipelined: while the verifier verifies a greedy request's tree, this worker, when idle,
        # drafts the request's next tree from the outcome its SSMs believe (`engine.pipeline`).
        self.drafter = Drafter(speculator, is_pipelined, on_ahead)
        self.speculator = speculator
        self.metrics = metrics
        if metrics is not None:
            for runner in speculator.runners:
                runner.on_forward = metrics.iteration_tokens.observe
        self.worker = BatchWorker("speculator-worker", self._process, max_batch, metrics, is_threaded)

    @property
    def is_pipelined(self) -> bool:
        return self.drafter.is_pipelined

    @property
    def num_ahead(self) -> dict[str, int]:
        return self.drafter.num_ahead

    @property
    def num_open(self) -> int:
        return self.drafter.num_open

    def open(self, context_ids: list[int], params: SamplingParams, shape: TreeShape,
             ssm_indices: list[int] | None = None) -> DraftSession:
        return self.drafter.open(context_ids, params, shape, ssm_indices)

    def step(self, session: DraftSession, feedback: tuple[list[int], int] | None, max_depth: int,
             shape: TreeShape | None = None, timeout: float | None = None, is_model_free_only: bool = False,
             budget: TreeBudget | None = None) -> tuple[TokenTree, float, int]:
        """Applies the verifier's feedback, then returns the next tree, the seconds it took and its
        SSM levels; `is_model_free_only` asks for the model-free members' drafts alone (no SSM
        pass), a `budget` for a dynamic tree."""
        return self.worker.call("step", session, feedback, max_depth, shape, is_model_free_only, budget,
                                timeout=timeout)

    def close(self, session: DraftSession) -> None:
        try:
            self.worker.call("close", session)
        except UnavailableError:  # shutting down: the whole cache goes with the process
            pass

    def _process(self, jobs: list[Job]) -> tuple[list[Job], bool] | None:
        self._build(jobs)
        if self.metrics is not None:
            used = sum(r.allocator.num_used for r in self.speculator.runners)
            free = sum(r.allocator.num_free for r in self.speculator.runners)
            self.metrics.observe_kv(used, free)
            self.metrics.requests_running.set(self.num_open)
        if not self.drafter.has_wanted:
            return None
        if self.worker.has_waiting:  # trees asked for come first; drafting ahead waits for a lull
            return [_AHEAD_JOB], True
        self.drafter.draft_ahead()
        return None

    @staticmethod
    def _ask(session: DraftSession, feedback: tuple[list[int], int] | None, max_depth: int,
             shape: TreeShape | None, is_model_free_only: bool, budget: TreeBudget | None) -> Ask:
        """One step's ask: one speculator's merged tree stays within the request's shape (the
        verifier reserved KV for that much per speculator); model-free members draft as deep as
        the request's bound allows. Depth 0 asks for the root alone."""
        if shape is not None:
            session.shape = shape
        proposal = None
        if max_depth > 0:
            proposal = session.proposal(session.shape.clipped(max_depth), max_depth, is_model_free_only,
                                        session.shape.max_nodes if budget is None else budget.max_nodes + 1, budget)
        outcomes = []
        if feedback is not None:
            outcomes.append((session.last, *feedback))
            session.last = None
        return Ask(session, proposal, outcomes)

    def _build(self, jobs: list[Job]) -> None:
        steps = []
        for job in jobs:
            if job.kind == "close":
                self.drafter.close(job.args[0])
                job.future.set_result(None)
            elif job.kind == "step":
                steps.append(job)
        asks = [self._ask(*job.args) for job in steps]
        for job, ask, (built, seconds) in zip(steps, asks, self.drafter.build(asks)):
            if built is None:
                job.future.set_result((self.drafter.root_tree(ask.session), seconds, 0))
            else:
                job.future.set_result((built.tree, seconds, built.num_levels))


_AHEAD_JOB = Job("ahead", ())
