"""One request's generation: a worker thread that consumes one Verifier.Generate stream.

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
from specinfer.params import GenerationParams
from specinfer.stats import GenerationStats
from specinfer.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

class _Stopped(Exception):
    """Raised in the worker when an observer or CancelRequest asked it to stop."""


@dataclass(frozen=True)
class RunPlan:
    request_id: str
    prompt: str  # the turn's text (for the session history)
    prompt_ids: tuple[int, ...]  # the full context: session history + this turn
    generated_ids: tuple[int, ...]  # tokens earlier segments produced (resume)
    params: GenerationParams  # max_new_tokens and seed resolved
    session_id: str
    session_base_len: int
    prior_stats: GenerationStats  # earlier segments' (resume)
    deadline_s: float  # for the verifier call
    metadata: tuple[tuple[str, str], ...]  # trace context for the verifier
    started_at: float  # time.monotonic() when the client's RPC arrived
    prefix_group: str = ""  # the verifier shares the prompt's KV within a group (the samples of one request)


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


class RequestRun:
    def __init__(self, plan: RunPlan, deps: RunDeps):
        self.plan = plan
        self.deps = deps
        self.request_id = plan.request_id
        self.cond = threading.Condition()
        self.text = TextState.replay(deps.tokenizer, plan.params.stop, plan.generated_ids, plan.params.stop_token_ids)
        self.logprobs: list[TokenLogprob] = []  # of the tokens after the earlier segments' (logprobs_from)
        self.logprobs_from = len(plan.generated_ids)
        self.logprob_space = ""
        self._num_cached = 0  # prompt tokens the verifier reused
        self.status = RUNNING
        self.finish_reason = ""
        self.final_text: str | None = None
        self.stats: GenerationStats | None = None
        self.error: Exception | None = None
        self.num_observers = 0
        self._stop_reason = ""  # "", "interrupted" or "cancelled"
        self._stream = None
        self._num_steps = 0
        self._verifier_stats: GenerationStats | None = None
        # Calls of this run that failed over to another verifier, as the gateway counted them.
        self._earlier_calls: GenerationStats | None = None
        self._call_first_step, self._call_first_token = 0, len(plan.generated_ids)
        self._last_token_at: float | None = None
        # Observers see a token only once it is in the store, so a client never holds a token
        # that a crash of this gateway would lose (a resume by offset always finds it).
        self._num_durable = len(plan.generated_ids)
        # What this run has written to the store: None until its first (whole-state) write, then
        # the tokens and visible characters stored, and the step fields it appended.
        self._num_stored_tokens: int | None = None
        self._num_stored_chars = 0
        self._step_offsets: list[int] = []
        self.ticket: Ticket | None = None  # its admission slot: told how far the run has come
        self._thread = threading.Thread(target=self._work, name=f"run-{plan.request_id}", daemon=True)

    # -- control (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def num_tokens(self) -> int:
        with self.cond:
            return self.text.num_tokens

    def attach(self) -> bool:
        """Registers an observer; False if the run is already ending."""
        with self.cond:
            if self._stop_reason or self.status != RUNNING:
                return False
            self.num_observers += 1
            return True

    def detach(self) -> None:
        with self.cond:
            self.num_observers -= 1
            if self.num_observers <= 0 and self.status == RUNNING:
                self._request_stop("interrupted")

    def cancel(self) -> bool:
        with self.cond:
            if self.status != RUNNING:
                return False
            self._request_stop("cancelled")
            return True

    def interrupt(self) -> None:
        with self.cond:
            if self.status == RUNNING:
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
    def text_len_at(self, num_tokens: int) -> int:
        with self.cond:
            return self.text.visible_lens[num_tokens]

    def read(self, since_tokens: int, since_chars: int, timeout_s: float) -> Chunk | None:
        """Waits up to `timeout_s` for progress past `since_tokens`; None if there is none."""
        with self.cond:
            if self.status == RUNNING and self._num_durable <= since_tokens:
                self.cond.wait(timeout_s)
            is_done = self.status != RUNNING
            n = self.text.num_tokens if is_done else self._num_durable
            if not is_done and n <= since_tokens:
                return None
            if is_done and self.final_text is not None:
                delta, num_chars = self.final_text[since_chars:], len(self.final_text)
            else:
                delta, num_chars = self.text.text_since(since_chars, n), self.text.visible_lens[n]
            return Chunk(self.request_id, tuple(self.text.ids[since_tokens:n]), since_tokens, delta,
                         n, max(num_chars, since_chars), is_done, self.status, self.finish_reason,
                         self.stats if is_done else None, self.error if is_done else None,
                         self._logprobs(since_tokens, n), self.logprob_space)

    def _logprobs(self, start: int, end: int) -> tuple[TokenLogprob, ...]:
        """Tokens [start, end)'s logprobs if this run holds them all, else none."""
        i, j = start - self.logprobs_from, end - self.logprobs_from
        return tuple(self.logprobs[i:j]) if i >= 0 and j <= len(self.logprobs) else ()

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

    def _call(self) -> VerifierCall:
        """The verifier call that generates the rest: a continuation sends the tokens generated so
        far as the prompt's tail (the verifier's penalties count them as output, a constraint
        resumes past them) and keeps the request's seed: a sampled token's noise depends on the
        seed and its position only, so the output is the one an uninterrupted call gives."""
        plan = self.plan
        with self.cond:
            done = tuple(self.text.ids)
        params = replace(plan.params, max_new_tokens=plan.params.max_new_tokens - len(done),
                         num_resumed_tokens=plan.params.num_resumed_tokens + len(done))
        return VerifierCall(plan.request_id, plan.prompt_ids + done, params, plan.session_id, plan.prefix_group)

    def _generate(self) -> None:
        """Verifier calls until the request ends. A call that fails with UNAVAILABLE (its verifier
        died, drains or cannot be reached) goes on on another serving verifier, from the tokens
        generated so far, within the deadline; with none, the request ends resumable."""
        plan = self.plan
        if len(plan.generated_ids) >= plan.params.max_new_tokens:
            return self._end(FINISHED, "length")
        failed_on: set[str] = set()
        for attempt in range(MAX_VERIFIER_ATTEMPTS):
            if self.num_tokens >= plan.params.max_new_tokens:  # a failed call had sent them all
                return self._end(FINISHED, "length")
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
                    end_reason = self._apply(step)
                    if end_reason:
                        stream.cancel()  # a stop string matched: free the verifier's KV now
                        return self._end(FINISHED, end_reason)
                    if step.finish_reason:
                        return self._end(FINISHED, step.finish_reason)
                    if self._persist_running():  # one store round trip per verified step
                        self.cancel()  # another gateway's CancelRequest
                return self._end(FINISHED, "length")
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

    def _fails_over(self, exc: PeerError) -> bool:
        """Whether a failed call goes on elsewhere: its verifier was unavailable, and nobody asked
        the run to stop (a stop cancels the call, which reads as a failure too)."""
        with self.cond:
            return isinstance(exc.cause, UnavailableError) and not self._stop_reason

    def _close_call(self) -> None:
        """Keeps what the failed call produced in this run's statistics (the gateway's counts)."""
        with self.cond:
            self._stream = None
            earlier = GenerationStats(prompt_tokens=len(self.plan.prompt_ids),
                                      output_tokens=self.text.num_tokens - self._call_first_token,
                                      llm_steps=self._num_steps - self._call_first_step,
                                      cached_prompt_tokens=self._num_cached)
            self._earlier_calls = earlier if self._earlier_calls is None else self._earlier_calls.merged(earlier)
            self._call_first_step, self._call_first_token = self._num_steps, self.text.num_tokens
            self._verifier_stats = None

    def _apply(self, step: VerifierStep) -> str:
        """Adds one verified step's tokens; returns a finish reason if the gateway ends it here."""
        max_new_tokens = self.plan.params.max_new_tokens
        end_reason = ""
        with self.cond:
            if self._stop_reason:
                raise _Stopped()
            if step.token_ids and self._last_token_at is None and not self.plan.generated_ids:
                self.deps.metrics.time_to_first_token.observe(time.monotonic() - self.plan.started_at)
            self._num_cached = max(self._num_cached, step.cached_prompt_tokens)
            self.logprob_space = step.logprob_space or self.logprob_space
            for i, token in enumerate(step.token_ids):
                if self.text.num_tokens >= max_new_tokens:
                    end_reason = "length"
                    break
                is_stop = self.text.push(token)
                if i < len(step.logprobs):
                    self.logprobs.append(step.logprobs[i])
                if is_stop:
                    end_reason = "stop"
                    break
            if self.ticket is not None:
                self.ticket.num_done = self.text.num_tokens - len(self.plan.generated_ids)
            if step.token_ids:
                now = self.deps.clock()
                if self._last_token_at is not None:
                    self.deps.on_step((now - self._last_token_at) / len(step.token_ids))
                self._last_token_at = now
                self._num_steps += 1
            if step.stats is not None:
                self._verifier_stats = step.stats
            self.cond.notify_all()
        return end_reason

    def _persist_running(self) -> bool:
        """Stores this step in one round trip: the whole state on the run's first write (a resumed
        record may predate this run), then only what each step adds."""
        with self.cond:
            num_tokens, num_chars = self.text.num_tokens, self.text.visible_lens[-1]
            offset = self._num_stored_tokens
            if offset is None:
                progress = Progress(RUNNING, tuple(self.text.ids), self.text.visible)
            else:
                ids = tuple(self.text.ids[offset:])
                delta = self.text.text_since(self._num_stored_chars, num_tokens)
        if offset is None:
            is_cancel_requested = self.deps.store.put_progress(self.request_id, progress)
        else:
            if ids:
                self._step_offsets.append(offset)
            is_cancel_requested = self.deps.store.put_step(self.request_id, offset, ids, delta)
        self._num_stored_tokens, self._num_stored_chars = num_tokens, num_chars
        with self.cond:
            self._num_durable = num_tokens
            self.cond.notify_all()
        return is_cancel_requested

    def _end_on_call_error(self, exc: Exception) -> None:
        with self.cond:
            reason = self._stop_reason
        if reason == "cancelled":
            return self._end(CANCELLED, "cancelled")
        if reason == "interrupted":
            return self._end(INTERRUPTED, "", UnavailableError(f"request {self.request_id} was interrupted; resume it"))
        if isinstance(exc, PeerError):
            return self._end(INTERRUPTED if exc.is_resumable else FAILED, "", exc.cause)
        return self._end(FAILED, "", domain_error(exc))

    def _segment_stats(self, num_tokens: int) -> GenerationStats:
        """This verifier call's statistics: the verifier's, or, when the gateway ended the call
        before its last message (a stop string, a cancel, an interruption), only what the gateway
        counted itself; the speculation figures are then unknown and stay unset."""
        latency_s = (self._last_token_at or time.monotonic()) - self.plan.started_at
        if self._verifier_stats is not None:
            last = replace(self._verifier_stats, latency_s=latency_s)
        else:
            last = GenerationStats(prompt_tokens=len(self.plan.prompt_ids),
                                   output_tokens=num_tokens - (self._call_first_token - len(self.plan.generated_ids)),
                                   llm_steps=self._num_steps - self._call_first_step, latency_s=latency_s,
                                   cached_prompt_tokens=self._num_cached)
        return last if self._earlier_calls is None else self._earlier_calls.merged(last)

    def _end(self, status: str, finish_reason: str, error: Exception | None = None) -> None:
        """Persists the final state first, then tells observers (so GetRequest agrees with them)."""
        with self.cond:
            ids = tuple(self.text.ids)
            is_final = status in (FINISHED, CANCELLED, FAILED)
            text = self.text.final_text() if is_final else self.text.visible
            segment = self._segment_stats(len(ids) - len(self.plan.generated_ids))
            stats = self.plan.prior_stats.merged(segment).with_counts(len(self.plan.prompt_ids), len(ids))
        self.deps.metrics.output_tokens.inc(len(ids) - len(self.plan.generated_ids))
        try:
            self.deps.store.put_progress(self.request_id, Progress(status, ids, text, finish_reason, stats,
                                                                   str(error or "")), tuple(self._step_offsets))
            if status == FINISHED and self.plan.session_id:
                self._append_turn(ids, text)
        except UnavailableError as exc:
            log.warning("request %s: could not store its final state: %s", self.request_id, exc)
        if status == INTERRUPTED and error is None:
            error = UnavailableError(f"request {self.request_id} was interrupted; resume it")
        if isinstance(error, CapacityError):
            error = CapacityError(f"{error}; request {self.request_id} can be resumed", error.retry_after_s)
        with self.cond:
            self.status, self.finish_reason, self.stats, self.error = status, finish_reason, stats, error
            self.final_text = text if is_final else None
            self.cond.notify_all()
        log.info("request %s %s", self.request_id, status,
                 extra={"fields": {"request_id": self.request_id, "status": status, "finish_reason": finish_reason,
                                   "output_tokens": len(ids), "error": str(error or "")}})

    def _append_turn(self, ids: tuple[int, ...], text: str) -> None:
        plan = self.plan
        turn_ids = plan.prompt_ids[plan.session_base_len:] + ids
        if not self.deps.store.append_turn(plan.session_id, plan.session_base_len, turn_ids, plan.prompt + text):
            log.warning("session %s changed during request %s (or is gone); turn not appended",
                        plan.session_id, self.request_id)


class RunRegistry:
    """The runs this gateway drives, each holding an admission ticket while it runs."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self._lock = threading.Lock()
        self._runs: dict[str, RequestRun] = {}
        self._tickets: dict[str, Ticket] = {}

    def get(self, request_id: str) -> RequestRun | None:
        with self._lock:
            return self._runs.get(request_id)

    def add(self, run: RequestRun, wait_s: float | None = None) -> RequestRun | None:
        """Adds `run` once admitted (waiting up to `wait_s` in the admission queue), or returns the
        run already driving that id; CapacityError when it is not admitted."""
        existing = self.get(run.request_id)
        if existing is not None:
            return existing
        plan = run.plan
        ticket = self.admission.acquire(len(plan.prompt_ids) + plan.params.max_new_tokens, wait_s,
                                        plan.params.max_new_tokens - len(plan.generated_ids), plan.prefix_group)
        with self._lock:
            existing = self._runs.get(run.request_id)
            if existing is None:
                self._runs[run.request_id], self._tickets[run.request_id] = run, ticket
                run.ticket = ticket
        if existing is not None:
            self.admission.release(ticket)
        return existing

    def remove(self, run: RequestRun) -> None:
        with self._lock:
            if self._runs.get(run.request_id) is not run:
                return
            del self._runs[run.request_id]
            ticket = self._tickets.pop(run.request_id)
        self.admission.release(ticket)

    def all(self) -> list[RequestRun]:
        with self._lock:
            return list(self._runs.values())
