"""One request's generation: a worker thread that consumes one Verifier.Generate stream (n > 1:
one stream for all the request's samples, each sample with its own state and stored record).

The worker appends every verified step's tokens to the request's state (in memory, and in the
store in one round trip per step that writes only that step), applies stop sequences and max
tokens, and records how the request ended, with the statistics measured (SpecInfer Section 6's
metrics: the verifier's, or only the gateway's own counts when it ended the verifier call early).
Client RPCs are observers: they read progress from here and never talk to the verifier
themselves, so a client can disconnect and later resume without losing tokens.

When the last observer leaves, the run is *interrupted*: the verifier call is cancelled (the
verifier frees the request's KV caches) and the request stays resumable. `cancel()` ends it
for good. The worker is the only writer of its request's record while it runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from services.gateway.admission import Admission, Ticket
from services.gateway.stops import TextState
from services.gateway.store import CANCELLED, FAILED, FINISHED, INTERRUPTED, RUNNING, Progress, Store
from services.gateway.telemetry import GatewayMetrics
from services.gateway.verifier_client import VerifierCall, VerifierStep, domain_error
from services.gateway.verifier_pool import RoutedVerifiers
from specinfer.errors import CapacityError, PeerError, UnavailableError
from specinfer.limits import MAX_VERIFIER_ATTEMPTS
from specinfer.logprobs import TokenLogprob
from specinfer.params import GenerationParams, SampleProgress
from specinfer.stats import GenerationStats
from specinfer.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

class _Stopped(Exception):
    """Raised in the worker when an observer or CancelRequest asked it to stop."""


@dataclass(frozen=True)
class RunPlan:
    request_id: str  # n > 1: the request's id; each sample has its own (`sample_ids`)
    prompt: str  # the turn's text (for the session history)
    prompt_ids: tuple[int, ...]  # the full context: session history + this turn
    generated_ids: tuple[int, ...]  # tokens earlier segments produced (resume; n = 1 only)
    params: GenerationParams  # max_new_tokens and seed resolved; num_samples: the samples of this run
    session_id: str
    session_base_len: int
    prior_stats: GenerationStats  # earlier segments' (resume)
    deadline_s: float  # for the verifier call
    metadata: tuple[tuple[str, str], ...]  # trace context for the verifier
    started_at: float  # time.monotonic() when the client's RPC arrived
    sample_ids: tuple[str, ...] = ()  # n > 1: each sample's id, the key of its stored record

    @property
    def record_ids(self) -> tuple[str, ...]:
        """The stored records this run writes: one per sample."""
        return self.sample_ids or (self.request_id,)


@dataclass(frozen=True)
class RunDeps:
    tokenizer: TextTokenizer
    store: Store
    verifier: RoutedVerifiers
    metrics: GatewayMetrics
    on_exit: Callable[["RequestRun"], None]
    # Seconds per output token between two verified steps: a speculative step brings several tokens
    # in one longer step, so per token its cost compares with a plain step's.
    on_step: Callable[[float], None] = lambda token_s: None
    clock: Callable[[], float] = time.monotonic  # when a verified step arrives (injectable for tests)


@dataclass(frozen=True)
class Chunk:
    """What an observer gets: progress since what it already holds."""

    request_id: str
    token_ids: tuple[int, ...]
    token_offset: int
    text_delta: str
    num_tokens: int  # tokens the observer holds after this chunk
    num_chars: int  # characters of text it holds after this chunk
    is_done: bool = False
    status: str = RUNNING
    finish_reason: str = ""
    stats: GenerationStats | None = None
    error: Exception | None = None
    # One entry per token of `token_ids` when the request asked for logprobs (and this gateway
    # saw them arrive: a request replayed from the store carries none), under `logprob_space`
    # ("raw" or "processed", specinfer.logprobs).
    logprobs: tuple[TokenLogprob, ...] = ()
    logprob_space: str = ""
    index: int = 0  # the sample of an n > 1 request this chunk belongs to
    group_id: str = ""  # n > 1: the request's id (`request_id` is the sample's own)


class _Sample:
    """One sample's state in a run: its tokens and text, how far the store holds them, and how it
    ended. Guarded by the run's condition."""

    def __init__(self, index: int, request_id: str, plan: RunPlan, tokenizer: TextTokenizer):
        self.index, self.request_id = index, request_id
        self.text = TextState.replay(tokenizer, plan.params.stop, plan.generated_ids, plan.params.stop_token_ids)
        self.logprobs: list[TokenLogprob] = []  # of the tokens after the earlier segments' (logprobs_from)
        self.logprobs_from = len(plan.generated_ids)
        self.logprob_space = ""
        self.num_cached = 0  # prompt tokens the verifier reused
        self.status = RUNNING
        self.finish_reason = ""
        self.final_text: str | None = None
        self.stats: GenerationStats | None = None
        self.error: Exception | None = None
        self.is_cancel_asked = False  # CancelRequest of this sample alone (n > 1)
        self.num_steps = 0
        self.verifier_stats: GenerationStats | None = None
        # Calls of this run that failed over to another verifier, as the gateway counted them.
        self.earlier_calls: GenerationStats | None = None
        self.call_first_step, self.call_first_token = 0, len(plan.generated_ids)
        self.last_token_at: float | None = None
        # Observers see a token only once it is in the store, so a client never holds a token
        # that a crash of this gateway would lose (a resume by offset always finds it).
        self.num_durable = len(plan.generated_ids)
        # What this run has written to the store: None until its first (whole-state) write, then
        # the tokens and visible characters stored, and the step fields it appended.
        self.num_stored_tokens: int | None = None
        self.num_stored_chars = 0
        self.step_offsets: list[int] = []

    @property
    def is_running(self) -> bool:
        return self.status == RUNNING


class RequestRun:
    """One request's run: one verifier call at a time for all its samples (n > 1: one call
    carries every sample, `VerifierCall.samples`), each sample with its own stored record."""

    def __init__(self, plan: RunPlan, deps: RunDeps):
        self.plan = plan
        self.deps = deps
        self.request_id = plan.request_id
        self.cond = threading.Condition()
        self.samples = [_Sample(i, rid, plan, deps.tokenizer) for i, rid in enumerate(plan.record_ids)]
        self.num_observers = 0
        self._stop_reason = ""  # "", "interrupted" or "cancelled"
        self._stream = None
        self.ticket: Ticket | None = None  # its admission slot: told how far the run has come
        self._thread = threading.Thread(target=self._work, name=f"run-{plan.request_id}", daemon=True)

    @property
    def is_group(self) -> bool:
        """Whether this run carries the samples of an n > 1 request."""
        return bool(self.plan.sample_ids)

    @property
    def status(self) -> str:
        """RUNNING until every sample has ended; then the status of the last sample (n = 1: its own)."""
        with self.cond:
            running = [s for s in self.samples if s.is_running]
            return RUNNING if running else self.samples[-1].status

    def index_of(self, record_id: str) -> int:
        return self.plan.record_ids.index(record_id)

    # -- control (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def num_tokens(self) -> int:
        """Tokens of its slowest running sample (of the sample, n = 1)."""
        with self.cond:
            running = [s.text.num_tokens for s in self.samples if s.is_running]
            return min(running) if running else min(s.text.num_tokens for s in self.samples)

    def num_tokens_of(self, index: int) -> int:
        with self.cond:
            return self.samples[index].text.num_tokens

    def attach(self) -> bool:
        """Registers an observer; False if the run is already ending."""
        with self.cond:
            if self._stop_reason or not any(s.is_running for s in self.samples):
                return False
            self.num_observers += 1
            return True

    def detach(self) -> None:
        with self.cond:
            self.num_observers -= 1
            if self.num_observers <= 0 and any(s.is_running for s in self.samples):
                self._request_stop("interrupted")

    def cancel(self, index: int | None = None) -> bool:
        """Ends the run for good (`index`: only that sample of an n > 1 run, at its next step)."""
        with self.cond:
            if index is not None and self.is_group:
                sample = self.samples[index]
                if not sample.is_running:
                    return False
                sample.is_cancel_asked = True
                if all(s.is_cancel_asked or not s.is_running for s in self.samples):
                    self._request_stop("cancelled")
                return True
            if not any(s.is_running for s in self.samples):
                return False
            self._request_stop("cancelled")
            return True

    def wait_ended(self, index: int, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.samples[index].is_running, timeout_s)

    def interrupt(self) -> None:
        with self.cond:
            if any(s.is_running for s in self.samples):
                self._request_stop("interrupted")

    def _request_stop(self, reason: str) -> None:
        if reason == "cancelled" or not self._stop_reason:
            self._stop_reason = reason
        if self.ticket is not None:  # its slot frees in a moment: admission predicts no wait for it
            self.ticket.num_done = self.ticket.num_new_tokens
        if self._stream is not None:
            self._stream.cancel()
        self.cond.notify_all()

    # -- observing ---------------------------------------------------------------------------
    def text_len_at(self, num_tokens: int, index: int = 0) -> int:
        with self.cond:
            return self.samples[index].text.visible_lens[num_tokens]

    def read(self, since_tokens: int, since_chars: int, timeout_s: float, index: int = 0) -> Chunk | None:
        """Waits up to `timeout_s` for progress of sample `index` past `since_tokens`; None if
        there is none."""
        with self.cond:
            sample = self.samples[index]
            if sample.is_running and sample.num_durable <= since_tokens:
                self.cond.wait(timeout_s)
            return self._chunk(sample, since_tokens, since_chars)

    def read_all(self, held: list[tuple[int, int, bool]], timeout_s: float) -> list[Chunk]:
        """Progress of every sample past what an observer holds (`held[i]`: sample i's tokens,
        characters, and whether it has seen it end), waiting up to `timeout_s` for any."""
        with self.cond:
            chunks = self._chunks(held)
            if not chunks:
                self.cond.wait(timeout_s)
                chunks = self._chunks(held)
            return chunks

    def _chunks(self, held: list[tuple[int, int, bool]]) -> list[Chunk]:
        out = []
        for sample, (since_tokens, since_chars, is_seen_done) in zip(self.samples, held):
            if not is_seen_done:
                chunk = self._chunk(sample, since_tokens, since_chars)
                if chunk is not None:
                    out.append(chunk)
        return out

    def _chunk(self, sample: _Sample, since_tokens: int, since_chars: int) -> Chunk | None:
        is_done = not sample.is_running
        n = sample.text.num_tokens if is_done else sample.num_durable
        if not is_done and n <= since_tokens:
            return None
        if is_done and sample.final_text is not None:
            delta, num_chars = sample.final_text[since_chars:], len(sample.final_text)
        else:
            delta, num_chars = sample.text.text_since(since_chars, n), sample.text.visible_lens[n]
        return Chunk(sample.request_id, tuple(sample.text.ids[since_tokens:n]), since_tokens, delta,
                     n, max(num_chars, since_chars), is_done, sample.status, sample.finish_reason,
                     sample.stats if is_done else None, sample.error if is_done else None,
                     self._logprobs(sample, since_tokens, n), sample.logprob_space, sample.index,
                     self.request_id if self.is_group else "")

    @staticmethod
    def _logprobs(sample: _Sample, start: int, end: int) -> tuple[TokenLogprob, ...]:
        """Tokens [start, end)'s logprobs if this run holds them all, else none."""
        i, j = start - sample.logprobs_from, end - sample.logprobs_from
        return tuple(sample.logprobs[i:j]) if i >= 0 and j <= len(sample.logprobs) else ()

    # -- the worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        self.deps.metrics.active_requests.inc()
        try:
            self._generate()
        except Exception as exc:  # noqa: BLE001 - a worker must always leave a final state
            log.exception("request %s: worker failed", self.request_id)
            self._end(FAILED, "", exc)
        finally:
            self.deps.metrics.active_requests.dec()
            self.deps.on_exit(self)

    def _running(self) -> list[_Sample]:
        with self.cond:
            return [s for s in self.samples if s.is_running]

    def _call(self) -> VerifierCall:
        """The verifier call that generates the rest: a continuation sends the tokens generated so
        far as the prompt's tail (the verifier's penalties count them as output, a constraint
        resumes past them) and keeps the request's seed: a sampled token's noise depends on the
        seed and its position only, so the output is the one an uninterrupted call gives. The
        samples of an n > 1 run go in one call; continued, it lists the samples still running,
        each with its tokens so far (the verifier extends the prompt with them alike)."""
        plan = self.plan
        with self.cond:
            if self.is_group:
                running = [s for s in self.samples if s.is_running]
                is_fresh = len(running) == len(self.samples) and not any(s.text.num_tokens for s in running)
                samples = () if is_fresh else tuple(SampleProgress(s.index, tuple(s.text.ids)) for s in running)
                return VerifierCall(plan.request_id, plan.prompt_ids, plan.params, plan.session_id, samples)
            done = tuple(self.samples[0].text.ids)
        params = replace(plan.params, max_new_tokens=plan.params.max_new_tokens - len(done),
                         num_resumed_tokens=plan.params.num_resumed_tokens + len(done))
        return VerifierCall(plan.request_id, plan.prompt_ids + done, params, plan.session_id)

    def _generate(self) -> None:
        """Verifier calls until the request ends. A call that fails with UNAVAILABLE (its verifier
        died, drains or cannot be reached) goes on on another serving verifier, from the tokens
        generated so far, within the deadline; with none, the request ends resumable."""
        plan = self.plan
        failed_on: set[str] = set()
        for attempt in range(MAX_VERIFIER_ATTEMPTS):
            for sample in self._running():  # a failed call had sent them all
                if sample.text.num_tokens >= plan.params.max_new_tokens:
                    self._end_sample(sample, FINISHED, "length")
            if not self._running():
                return
            timeout_s = plan.deadline_s - (time.monotonic() - plan.started_at)
            if timeout_s <= 0:
                return self._end(INTERRUPTED, "", TimeoutError(f"request {self.request_id}: deadline passed"))
            try:
                stream = self.deps.verifier.generate(self._call(), timeout_s, list(plan.metadata),
                                                     frozenset(failed_on))
            except UnavailableError as exc:  # no verifier serves: stay resumable
                return self._end(INTERRUPTED, "", exc)
            with self.cond:
                self._stream = stream
                if self._stop_reason:
                    stream.cancel()
            try:
                for step in stream:
                    if not 0 <= step.sample_index < len(self.samples):
                        raise RuntimeError(f"the verifier sent sample {step.sample_index} of {len(self.samples)}")
                    sample = self.samples[step.sample_index]
                    if sample.is_running:
                        self._step(sample, step)
                    if not self._running():
                        if not step.finish_reason:  # the gateway ended it (a stop string): free the KV now
                            stream.cancel()
                        return
                for sample in self._running():
                    self._end_sample(sample, FINISHED, "length")
                return
            except PeerError as exc:
                if not self._fails_over(exc) or attempt + 1 == MAX_VERIFIER_ATTEMPTS:
                    return self._end_on_call_error(exc)
                log.warning("request %s: verifier %s failed (%s); going on on another verifier", self.request_id,
                            stream.address, exc.cause)
                failed_on.add(stream.address)
                self._close_call()
                self.deps.metrics.verifier_failovers.inc()
            except _Stopped as exc:
                return self._end_on_call_error(exc)
            except UnavailableError as exc:  # the store failed mid-request: stop, stay resumable
                stream.cancel()
                return self._end(INTERRUPTED, "", exc)
        raise AssertionError("unreachable")

    def _step(self, sample: _Sample, step: VerifierStep) -> None:
        """One verified step of one sample: applied, then ended or stored."""
        end_reason = self._apply(sample, step)
        if end_reason:
            return self._end_sample(sample, FINISHED, end_reason)
        if step.finish_reason:
            return self._end_sample(sample, FINISHED, step.finish_reason)
        is_cancel_requested = self._persist_running(sample)  # one store round trip per verified step
        with self.cond:
            is_cancel_asked = sample.is_cancel_asked
        if is_cancel_requested and not self.is_group:
            self.cancel()  # another gateway's CancelRequest
        elif is_cancel_requested or is_cancel_asked:
            self._end_sample(sample, CANCELLED, "cancelled")

    def _fails_over(self, exc: PeerError) -> bool:
        """Whether a failed call goes on elsewhere: its verifier was unavailable, and nobody asked
        the run to stop (a stop cancels the call, which reads as a failure too)."""
        with self.cond:
            return isinstance(exc.cause, UnavailableError) and not self._stop_reason

    def _close_call(self) -> None:
        """Keeps what the failed call produced in each sample's statistics (the gateway's counts)."""
        with self.cond:
            self._stream = None
            for s in self.samples:
                if not s.is_running:
                    continue
                earlier = GenerationStats(prompt_tokens=len(self.plan.prompt_ids),
                                          output_tokens=s.text.num_tokens - s.call_first_token,
                                          llm_steps=s.num_steps - s.call_first_step,
                                          cached_prompt_tokens=s.num_cached)
                s.earlier_calls = earlier if s.earlier_calls is None else s.earlier_calls.merged(earlier)
                s.call_first_step, s.call_first_token = s.num_steps, s.text.num_tokens
                s.verifier_stats = None

    def _apply(self, sample: _Sample, step: VerifierStep) -> str:
        """Adds one verified step's tokens; returns a finish reason if the gateway ends it here."""
        max_new_tokens = self.plan.params.max_new_tokens
        end_reason = ""
        with self.cond:
            if self._stop_reason:
                raise _Stopped()
            if step.token_ids and sample.last_token_at is None and not self.plan.generated_ids:
                self.deps.metrics.time_to_first_token.observe(time.monotonic() - self.plan.started_at)
            sample.num_cached = max(sample.num_cached, step.cached_prompt_tokens)
            sample.logprob_space = step.logprob_space or sample.logprob_space
            for i, token in enumerate(step.token_ids):
                if sample.text.num_tokens >= max_new_tokens:
                    end_reason = "length"
                    break
                is_stop = sample.text.push(token)
                if i < len(step.logprobs):
                    sample.logprobs.append(step.logprobs[i])
                if is_stop:
                    end_reason = "stop"
                    break
            self._update_ticket()
            if step.token_ids:
                now = self.deps.clock()
                if sample.last_token_at is not None:
                    self.deps.on_step((now - sample.last_token_at) / len(step.token_ids))
                sample.last_token_at = now
                sample.num_steps += 1
            if step.stats is not None:
                sample.verifier_stats = step.stats
            self.cond.notify_all()
        return end_reason

    def _update_ticket(self) -> None:
        """Tells admission how far the run has come: as far as its slowest running sample."""
        if self.ticket is None:
            return
        base, max_new = len(self.plan.generated_ids), self.plan.params.max_new_tokens
        self.ticket.num_done = min((s.text.num_tokens if s.is_running else max_new) - base for s in self.samples)

    def _persist_running(self, sample: _Sample) -> bool:
        """Stores this step in one round trip: the whole state on the run's first write (a resumed
        record may predate this run), then only what each step adds."""
        with self.cond:
            num_tokens, num_chars = sample.text.num_tokens, sample.text.visible_lens[-1]
            offset = sample.num_stored_tokens
            if offset is None:
                progress = Progress(RUNNING, tuple(sample.text.ids), sample.text.visible)
            else:
                ids = tuple(sample.text.ids[offset:])
                delta = sample.text.text_since(sample.num_stored_chars, num_tokens)
        if offset is None:
            is_cancel_requested = self.deps.store.put_progress(sample.request_id, progress)
        else:
            if ids:
                sample.step_offsets.append(offset)
            is_cancel_requested = self.deps.store.put_step(sample.request_id, offset, ids, delta)
        sample.num_stored_tokens, sample.num_stored_chars = num_tokens, num_chars
        with self.cond:
            sample.num_durable = num_tokens
            self.cond.notify_all()
        return is_cancel_requested

    def _end_on_call_error(self, exc: Exception) -> None:
        with self.cond:
            reason = self._stop_reason
        if reason == "cancelled":
            return self._end(CANCELLED, "cancelled")
        if reason == "interrupted":
            return self._end(INTERRUPTED, "", None)
        if isinstance(exc, PeerError):
            return self._end(INTERRUPTED if exc.is_resumable else FAILED, "", exc.cause)
        return self._end(FAILED, "", domain_error(exc))

    def _segment_stats(self, sample: _Sample, num_tokens: int) -> GenerationStats:
        """This verifier call's statistics: the verifier's, or, when the gateway ended the call
        before its last message (a stop string, a cancel, an interruption), only what the gateway
        counted itself; the speculation figures are then unknown and stay unset."""
        latency_s = (sample.last_token_at or time.monotonic()) - self.plan.started_at
        if sample.verifier_stats is not None:
            last = replace(sample.verifier_stats, latency_s=latency_s)
        else:
            last = GenerationStats(prompt_tokens=len(self.plan.prompt_ids),
                                   output_tokens=num_tokens - (sample.call_first_token - len(self.plan.generated_ids)),
                                   llm_steps=sample.num_steps - sample.call_first_step, latency_s=latency_s,
                                   cached_prompt_tokens=sample.num_cached)
        return last if sample.earlier_calls is None else sample.earlier_calls.merged(last)

    def _end(self, status: str, finish_reason: str, error: Exception | None = None) -> None:
        """Ends every sample still running."""
        for sample in self._running():
            self._end_sample(sample, status, finish_reason, error)

    def _end_sample(self, sample: _Sample, status: str, finish_reason: str, error: Exception | None = None) -> None:
        """Persists the sample's final state first, then tells observers (so GetRequest agrees)."""
        with self.cond:
            ids = tuple(sample.text.ids)
            is_final = status in (FINISHED, CANCELLED, FAILED)
            text = sample.text.final_text() if is_final else sample.text.visible
            segment = self._segment_stats(sample, len(ids) - len(self.plan.generated_ids))
            stats = self.plan.prior_stats.merged(segment).with_counts(len(self.plan.prompt_ids), len(ids))
        self.deps.metrics.output_tokens.inc(len(ids) - len(self.plan.generated_ids))
        try:
            self.deps.store.put_progress(sample.request_id, Progress(status, ids, text, finish_reason, stats,
                                                                     str(error or "")), tuple(sample.step_offsets))
            if status == FINISHED and self.plan.session_id:
                self._append_turn(ids, text)
        except UnavailableError as exc:
            log.warning("request %s: could not store its final state: %s", sample.request_id, exc)
        if status == INTERRUPTED and error is None:
            error = UnavailableError(f"request {sample.request_id} was interrupted; resume it")
        if isinstance(error, CapacityError):
            error = CapacityError(f"{error}; request {sample.request_id} can be resumed", error.retry_after_s)
        with self.cond:
            sample.status, sample.finish_reason, sample.stats, sample.error = status, finish_reason, stats, error
            sample.final_text = text if is_final else None
            self._update_ticket()
            self.cond.notify_all()
        log.info("request %s %s", sample.request_id, status,
                 extra={"fields": {"request_id": sample.request_id, "status": status, "finish_reason": finish_reason,
                                   "output_tokens": len(ids), "error": str(error or "")}})

    def _append_turn(self, ids: tuple[int, ...], text: str) -> None:
        plan = self.plan
        turn_ids = plan.prompt_ids[plan.session_base_len:] + ids
        if not self.deps.store.append_turn(plan.session_id, plan.session_base_len, turn_ids, plan.prompt + text):
            log.warning("session %s changed during request %s (or is gone); turn not appended",
                        plan.session_id, self.request_id)


class RunRegistry:
    """The runs this gateway drives, each holding an admission ticket while it runs; found by the
    id of each record they write (a sample's id finds its n > 1 run), and an n > 1 run also by its
    request's id (`get_group`)."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self._lock = threading.Lock()
        self._runs: dict[str, RequestRun] = {}
        self._groups: dict[str, RequestRun] = {}
        self._tickets: dict[int, Ticket] = {}  # by id(run)

    def get(self, request_id: str) -> RequestRun | None:
        with self._lock:
            return self._runs.get(request_id)

    def get_group(self, request_id: str) -> RequestRun | None:
        with self._lock:
            return self._groups.get(request_id)

    def _existing(self, run: RequestRun) -> RequestRun | None:
        if run.is_group:
            return self._groups.get(run.request_id) or next(
                (self._runs[i] for i in run.plan.record_ids if i in self._runs), None)
        return self._runs.get(run.request_id)

    def add(self, run: RequestRun, wait_s: float | None = None) -> RequestRun | None:
        """Adds `run` once admitted (waiting up to `wait_s` in the admission queue), or returns the
        run already driving that id; CapacityError when it is not admitted."""
        with self._lock:
            existing = self._existing(run)
        if existing is not None:
            return existing
        plan = run.plan
        num = len(plan.record_ids)
        num_new = plan.params.max_new_tokens - len(plan.generated_ids)
        ticket = self.admission.acquire(len(plan.prompt_ids) + num * plan.params.max_new_tokens, wait_s, num_new, num)
        with self._lock:
            existing = self._existing(run)
            if existing is None:
                for record_id in plan.record_ids:
                    self._runs[record_id] = run
                if run.is_group:
                    self._groups[run.request_id] = run
                self._tickets[id(run)] = ticket
                run.ticket = ticket
        if existing is not None:
            self.admission.release(ticket)
        return existing

    def remove(self, run: RequestRun) -> None:
        with self._lock:
            ticket = self._tickets.pop(id(run), None)
            if ticket is None:
                return
            for record_id in run.plan.record_ids:
                if self._runs.get(record_id) is run:
                    del self._runs[record_id]
            if self._groups.get(run.request_id) is run:
                del self._groups[run.request_id]
        self.admission.release(ticket)

    def all(self) -> list[RequestRun]:
        with self._lock:
            return list({id(r): r for r in self._runs.values()}.values())
