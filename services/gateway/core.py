"""The gateway's request handling, in domain terms (no protobuf here).

SpecInfer's serving system (Section 5) puts a request manager in front of the LLM: it receives
client requests, schedules them, and streams results back. Here that is: validate, tokenize,
admit (`Admission`: a limit on running requests fitted to the step times the verifiers measure,
and the free KV they report; a request whose predicted wait exceeds its bound is refused at once
with a retry hint), start a `RequestRun`, and let the client's RPC
observe it. A request can be observed again later by id (resume): from this gateway's live run,
from the store's record, or, for an interrupted request, by starting a new verifier call that
continues from the tokens generated so far. Sizes come before contents: a text is measured
before it is tokenized, and tokenizing runs on the request's own RPC thread, holding nothing
(not even the GIL) that other requests wait on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Protocol

from services.gateway.admission import Admission, VerifierView
from services.gateway.config import GatewayConfig
from services.gateway.runs import Chunk, RequestRun, RunDeps, RunPlan, RunRegistry
from services.gateway.stops import TextState
from services.gateway.store import INTERRUPTED, RUNNING, RequestRecord, SessionRecord, Store
from services.gateway.telemetry import GatewayMetrics
from services.gateway.validation import NewRequest, validate_request
from services.gateway.verifier_client import VerifierSummary
from services.gateway.verifier_pool import RoutedVerifiers
from specinfer.errors import NotFoundError, UnavailableError, UserError
from specinfer.limits import check_id, check_prompt_length, check_text_size
from specinfer.params import GenerationParams, sample_params
from specinfer.stats import GenerationStats
from specinfer.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

INFO_TTL_S = 60.0  # how long the verifier's Info answer is trusted
INFO_RETRY_S = 5.0  # how soon a verifier that did not answer Info is asked again
INFO_REFRESH_S = 1.0  # an unknown SSM name re-asks Info once the answer is this old (a speculator joined)
POLL_S = 0.25  # how often an observer re-checks that its client is still there
FOLLOW_POLL_S = 0.05  # how often a request running on another gateway is re-read from the store


class ClientLink(Protocol):
    """The part of grpc.ServicerContext the core needs: is the client still there?"""

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool: ...


Events = Callable[[str, dict], None]  # span events: name, attributes


@dataclass(frozen=True)
class CallContext:
    """Per-RPC things the core passes on: the verifier deadline and the trace context."""

    link: ClientLink
    deadline_s: float
    metadata: tuple[tuple[str, str], ...] = ()
    on_event: Events = lambda name, attrs: None
    started_at: float = 0.0


@dataclass(frozen=True)
class VerifierFacts:
    """What the gateway checks against from Verifier.Info; None = unknown, checked by the verifier."""

    max_context: int | None = None
    ssm_names: tuple[str, ...] | None = None  # the SSMs a request may name (None: any)
    kv_capacity_tokens: int = 0  # 0 = unknown


def same_params(stored: GenerationParams, asked: GenerationParams) -> bool:
    """Whether a retry asks for what the stored request does; a retry that names no seed matches
    the seed the gateway drew for the original."""
    if asked.sampling.seed is None:
        stored = replace(stored, sampling=replace(stored.sampling, seed=None))
    return stored == asked


class _Attachment:
    """One observer's hold on a run (on its sample `index`), released when the client's RPC ends;
    closing twice is harmless."""

    def __init__(self, run: RequestRun, index: int = 0):
        self.run = run
        self.index = index
        self._lock = threading.Lock()
        self._is_closed = False

    @classmethod
    def hold(cls, run: RequestRun, link: ClientLink, record_id: str = "") -> "_Attachment | None":
        """Attaches to `run` for the life of the client's RPC (to the sample whose record is
        `record_id`; default the first); None if the run is already ending."""
        if not run.attach():
            return None
        attachment = cls(run, run.index_of(record_id) if record_id else 0)
        if not link.add_callback(attachment.close):  # the RPC has already ended
            attachment.close()
        return attachment

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        self.run.detach()


def encode_turn(tokenizer: TextTokenizer, text: str, has_history: bool) -> tuple[int, ...]:
    """A turn's token ids; a continuation turn gets no second BOS."""
    ids = tokenizer.encode(text)
    if has_history and tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]:
        ids = ids[1:]
    return tuple(ids)


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, tokenizer: TextTokenizer, store: Store, verifier: RoutedVerifiers,
                 metrics: GatewayMetrics):
        self.cfg = cfg
        self.limits = cfg.limits
        self.tokenizer = tokenizer
        self.store = store
        self.verifier = verifier
        self.metrics = metrics
        self.admission = Admission(replace(cfg.admission, max_running=cfg.limits.max_concurrent_requests))
        self.registry = RunRegistry(self.admission)
        metrics.admission_limit.set_function(lambda: self.admission.limit)
        metrics.queued_requests.set_function(lambda: self.admission.num_queued)
        self.deps = RunDeps(tokenizer, store, verifier, metrics, self.registry.remove, self._observe_step)
        self._facts_lock = threading.Lock()
        self._facts = VerifierFacts()
        self._facts_asked_at = 0.0
        self._facts_expire = 0.0
        self._lease_stop = threading.Event()
        self._lease_thread: threading.Thread | None = None

    # -- liveness ----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts renewing this gateway's liveness lease, so that if the process dies, other
        gateways take its running requests over within `lease_ttl_s` (not `stale_after_s`)."""
        self._renew_lease()
        self._lease_thread = threading.Thread(target=self._keep_lease, name="gateway-lease", daemon=True)
        self._lease_thread.start()

    @property
    def is_leasing(self) -> bool:
        return self._lease_thread is not None and not self._lease_stop.is_set()

    def _renew_lease(self) -> None:
        try:
            self.store.renew_lease(self.cfg.gateway_id, self.cfg.lease_ttl_s)
        except UnavailableError as exc:
            log.warning("could not renew this gateway's lease: %s", exc)

    def _keep_lease(self) -> None:
        while not self._lease_stop.wait(self.cfg.lease_ttl_s / 4):
            self._renew_lease()

    def _owner_is_gone(self, rec: RequestRecord) -> bool:
        """Whether a running request's gateway is gone: its lease lapsed (gateways that keep one),
        or the request made no progress for `stale_after_s`."""
        if rec.updated_at < time.time() - self.cfg.stale_after_s:
            return True
        return rec.is_leased and rec.owner != self.cfg.gateway_id and not self.store.has_lease(rec.owner)

    def _observe_step(self, token_s: float) -> None:
        self.admission.observe_step(token_s, self.admission.num_running)

    def refresh_verifiers(self) -> None:
        """Admission follows the serving verifiers' latest reports (after each, and as they come and go)."""
        self.admission.set_verifiers([VerifierView(load, mine) for load, mine in self.verifier.loads()])

    # -- draining (specinfer.serving.drain.Drainable) -------------------------------------------
    def stop_taking(self) -> None:
        """No new request from now on; one that arrives or waits in the queue gets UNAVAILABLE."""
        self.admission.close()

    def in_flight(self) -> list[tuple[str, int]]:
        return [(run.request_id, run.plan.params.max_new_tokens - run.num_tokens) for run in self.registry.all()]

    def token_s(self) -> float | None:
        return self.admission.token_s()

    def hand_over(self, request_ids: list[str]) -> None:
        """Interrupts these runs: each stays resumable (its tokens are in the store), its client gets
        UNAVAILABLE, and another gateway continues it on ResumeStream (this one drops its lease as
        it exits, so the takeover does not wait for it to lapse)."""
        wanted = set(request_ids)
        for run in self.registry.all():
            if run.request_id in wanted:
                run.interrupt()

    # -- generate ----------------------------------------------------------------------------
    def generate(self, req: NewRequest, call: CallContext) -> Iterator[Chunk]:
        """Validates and starts a request; yields a header chunk, then its progress. With n > 1,
        every sample's (see `_generate_samples`)."""
        req = validate_request(req, self.limits)
        if req.params.num_samples > 1:
            yield from self._generate_samples(req, call)
            return
        if req.request_id:
            existing = self.store.get_request(req.request_id)
            if existing is not None:
                yield from self._retry(req, existing, call)
                return
        self._check_ssm_names(req.params.ssm_names)
        session = self._session(req.session_id) if req.session_id else None
        history = session.history_ids if session else ()
        turn_ids = encode_turn(self.tokenizer, req.prompt, bool(history))
        check_prompt_length(len(turn_ids), len(history), self.limits)
        self._check_context(len(history) + len(turn_ids), req.params.max_new_tokens)
        request_id = req.request_id or uuid.uuid4().hex
        params = req.params
        if params.sampling.seed is None:
            params = replace(params, sampling=replace(params.sampling, seed=secrets.randbits(63)))
        record = RequestRecord(request_id, RUNNING, req.prompt, req.session_id, params.to_json(), history + turn_ids,
                               owner=self.cfg.gateway_id, session_base_len=len(history), is_leased=self.is_leasing)
        run = RequestRun(self._plan(record, call), self.deps)
        self.admission.set_kv_capacity(self._verifier_facts().kv_capacity_tokens)
        concurrent = self.registry.add(run, call.deadline_s)  # not None: the same id arrived concurrently
        is_new = concurrent is None
        if concurrent is not None:
            self._check_retry(req, concurrent.plan.prompt, concurrent.plan.session_id, concurrent.plan.params)
        else:
            try:
                is_new = self.store.create_request(record)
            except BaseException:
                self.registry.remove(run)
                raise
            if not is_new:
                self.registry.remove(run)
                stored = self.store.get_request(request_id)
                if stored is not None:
                    self._check_retry(req, stored.prompt, stored.session_id, GenerationParams.from_json(stored.params))
        attachment = _Attachment.hold(run, call.link) if is_new else None
        if is_new:
            run.start()
        try:
            yield Chunk(request_id, (), 0, "", 0, 0)  # the id first, so a client can always resume
            yield from self._stream(request_id, 0, call, attachment)
        finally:
            if attachment is not None:
                attachment.close()

    def _generate_samples(self, req: NewRequest, call: CallContext) -> Iterator[Chunk]:
        """n > 1: one run, one verifier call for every sample (the verifier reads the prompt once
        and seeds sample i with `sample_seed(seed, i)`). Each sample keeps a record of its own,
        with the id "<request id>.<index>" and its own seed (`sample_params`), so each is
        resumable and readable by itself. Chunks come as the samples progress, told apart by
        `Chunk.index`; the first chunk of each sample carries its id."""
        num = req.params.num_samples
        if req.session_id:
            raise UserError("n: samples cannot continue a session (each would append its own turn); use n = 1")
        group = req.request_id or uuid.uuid4().hex
        sample_ids = tuple(f"{group}.{i}" for i in range(num))
        check_id(sample_ids[-1])  # a client's id leaves room for the samples' suffixes
        if req.request_id and (self.registry.get_group(group) is not None
                               or self.store.get_request(sample_ids[0]) is not None):
            yield from self._retry_samples(req, group, sample_ids, call)
            return
        self._check_ssm_names(req.params.ssm_names)
        turn_ids = encode_turn(self.tokenizer, req.prompt, False)
        check_prompt_length(len(turn_ids), 0, self.limits)
        self._check_context(len(turn_ids), req.params.max_new_tokens)
        params = req.params
        if params.sampling.seed is None:
            params = replace(params, sampling=replace(params.sampling, seed=secrets.randbits(63)))
        records = [RequestRecord(sid, RUNNING, req.prompt, "", sample_params(params, i).to_json(), turn_ids,
                                 owner=self.cfg.gateway_id, is_leased=self.is_leasing)
                   for i, sid in enumerate(sample_ids)]
        plan = replace(self._plan(records[0], call), request_id=group, params=params, sample_ids=sample_ids)
        run = RequestRun(plan, self.deps)
        self.admission.set_kv_capacity(self._verifier_facts().kv_capacity_tokens)
        concurrent = self.registry.add(run, call.deadline_s)  # not None: the same id arrived concurrently
        if concurrent is not None:
            self._check_sample_retry(req, concurrent.plan.prompt, concurrent.plan.session_id, concurrent.plan.params)
            yield from self._retry_samples(req, group, sample_ids, call)
            return
        try:
            is_new = all([self.store.create_request(record) for record in records])
        except BaseException:
            self.registry.remove(run)
            raise
        if not is_new:  # another gateway took the id meanwhile: a retry (it continues what it created)
            self.registry.remove(run)
            yield from self._retry_samples(req, group, sample_ids, call)
            return
        attachment = _Attachment.hold(run, call.link)
        run.start()
        try:
            for i, sid in enumerate(sample_ids):  # the ids first, so a client can always resume
                yield Chunk(sid, (), 0, "", 0, 0, index=i, group_id=group)
            yield from self._observe_samples(attachment, call.link)
        finally:
            if attachment is not None:
                attachment.close()

    def _retry_samples(self, req: NewRequest, group: str, sample_ids: tuple[str, ...], call: CallContext
                       ) -> Iterator[Chunk]:
        """An n > 1 request whose id is in use: the same request's samples, observed in one go
        while their run is live here, else one sample after the other (each from its record,
        continued here when it was interrupted)."""
        live = self.registry.get_group(group)
        if live is not None:
            self._check_sample_retry(req, live.plan.prompt, live.plan.session_id, live.plan.params)
        else:
            stored = self.store.get_request(sample_ids[0])
            if stored is None:
                raise NotFoundError(f"request_id: unknown request {sample_ids[0]!r}")
            self._check_sample_retry(req, stored.prompt, stored.session_id, GenerationParams.from_json(stored.params))
        call.on_event("retry", {"request_id": group})
        for i, sid in enumerate(sample_ids):
            yield Chunk(sid, (), 0, "", 0, 0, index=i, group_id=group)
        attachment = _Attachment.hold(live, call.link) if live is not None else None
        if attachment is not None:
            yield from self._observe_samples(attachment, call.link)
            return
        for i, sid in enumerate(sample_ids):
            for chunk in self._stream(sid, 0, call):
                yield replace(chunk, index=i, group_id=group)

    def _check_sample_retry(self, req: NewRequest, prompt: str, session_id: str, params: GenerationParams) -> None:
        """An n > 1 request's id may only be reused by the same request: compared as sample 0."""
        self._check_retry(replace(req, params=sample_params(req.params, 0)), prompt, session_id,
                          sample_params(params, 0))

    def _observe_samples(self, attachment: _Attachment | None, link: ClientLink) -> Iterator[Chunk]:
        """Every sample's progress in one n > 1 run, as it comes; the first error ends it."""
        if attachment is None:  # the run ended before the client attached: read the records
            return
        run = attachment.run
        try:
            held = [(0, 0, False)] * len(run.samples)
            while not all(is_done for _, _, is_done in held):
                chunks = run.read_all(held, POLL_S)
                if not chunks and not link.is_active():
                    return
                for chunk in chunks:
                    held[chunk.index] = (chunk.num_tokens, chunk.num_chars, chunk.is_done)
                    if chunk.error is not None:
                        if chunk.token_ids or chunk.text_delta:
                            yield replace(chunk, is_done=False, finish_reason="", stats=None, error=None)
                        raise chunk.error
                    yield chunk
        finally:
            attachment.close()

    def _retry(self, req: NewRequest, existing: RequestRecord, call: CallContext) -> Iterator[Chunk]:
        self._check_retry(req, existing.prompt, existing.session_id, GenerationParams.from_json(existing.params))
        call.on_event("retry", {"request_id": req.request_id})
        yield Chunk(req.request_id, (), 0, "", 0, 0)
        yield from self._stream(req.request_id, 0, call)

    @staticmethod
    def _check_retry(req: NewRequest, prompt: str, session_id: str, params: GenerationParams) -> None:
        """A request id already in use may only be reused by the same request (a retry)."""
        if prompt != req.prompt or session_id != req.session_id:
            raise UserError(f"request_id: {req.request_id!r} is already used by a different request")
        if not same_params(params, req.params):
            raise UserError(f"request_id: {req.request_id!r} is already used with different parameters")

    def _check_ssm_names(self, ssm_names: tuple[str, ...]) -> None:
        """Named SSMs must be hosted (from Verifier.Info); unknown while the verifier cannot say."""
        if not ssm_names:
            return
        hosted = self._verifier_facts().ssm_names
        if hosted is not None and not set(ssm_names) <= set(hosted):
            hosted = self._verifier_facts(max_age_s=INFO_REFRESH_S).ssm_names
        unknown = [name for name in ssm_names if hosted is not None and name not in hosted]
        if unknown:
            raise UserError(f"ssm_names: no SSM named {', '.join(unknown)} (the verifier has {', '.join(hosted)})")

    def _check_context(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Prompt plus max_new_tokens must fit the LLM's context (from Verifier.Info, cached for a minute)."""
        max_context = self._verifier_facts().max_context
        if max_context and num_prompt_tokens + max_new_tokens > max_context:
            raise UserError(f"max_tokens: the prompt's {num_prompt_tokens} tokens plus max_tokens={max_new_tokens} "
                            f"exceed the model's context of {max_context} tokens")

    def _verifier_facts(self, max_age_s: float | None = None) -> VerifierFacts:
        """Verifier.Info's answer, cached for INFO_TTL_S (or asked again when older than `max_age_s`)."""
        now = time.monotonic()
        with self._facts_lock:
            is_fresh = max_age_s is None or now - self._facts_asked_at < max_age_s
            if now < self._facts_expire and is_fresh:
                return self._facts
        try:
            info = self.verifier.info(0.5, [])
        except Exception:  # noqa: BLE001 - unknown for now; the verifier checks it itself
            facts, ttl_s = VerifierFacts(), INFO_RETRY_S
        else:
            # A verifier without speculators ignores SSM names; one whose speculators are all
            # unreachable lists none: then any name may go on, and the verifier decides.
            names = tuple(info.ssm_names) if info.num_speculators and info.ssm_names else None
            facts, ttl_s = VerifierFacts(info.max_context or None, names, info.kv_capacity_tokens), INFO_TTL_S
        with self._facts_lock:
            self._facts, self._facts_asked_at, self._facts_expire = facts, now, now + ttl_s
        return facts

    def _session(self, session_id: str) -> SessionRecord:
        session = self.store.get_session(session_id)
        if session is None:
            raise NotFoundError(f"session_id: unknown session {session_id!r}")
        return session

    def _plan(self, rec: RequestRecord, call: CallContext) -> RunPlan:
        return RunPlan(rec.request_id, rec.prompt, rec.prompt_ids, rec.generated_ids,
                       GenerationParams.from_json(rec.params), rec.session_id, rec.session_base_len,
                       rec.stats or GenerationStats(), call.deadline_s, call.metadata,
                       call.started_at or time.monotonic())

    # -- resume ------------------------------------------------------------------------------
    def resume(self, request_id: str, token_offset: int, call: CallContext) -> Iterator[Chunk]:
        check_id(request_id)
        if token_offset < 0:
            raise UserError(f"token_offset: must be >= 0, got {token_offset}")
        call.on_event("resume", {"request_id": request_id, "token_offset": token_offset})
        yield from self._stream(request_id, token_offset, call)

    def _stream(self, request_id: str, offset: int, call: CallContext, attachment: _Attachment | None = None
                ) -> Iterator[Chunk]:
        """Yields progress after `offset` tokens until the request ends or the client leaves."""
        num_tokens, num_chars = offset, None
        for _ in range(8):  # re-resolutions: a run ending under us, a request changing hands
            if attachment is None:
                attachment, record = self._resolve(request_id, num_tokens, call)
            if attachment is not None:
                chunks = self._observe(attachment, num_tokens, num_chars, call.link)
            else:
                chunks = self._follow(record, num_tokens, num_chars, call.link)
            is_done = False
            for chunk in chunks:
                chunk = replace(chunk, index=0, group_id="")  # one record's stream, whatever run drives it
                num_tokens, num_chars, is_done = chunk.num_tokens, chunk.num_chars, chunk.is_done
                if chunk.error is not None:
                    if chunk.token_ids or chunk.text_delta:
                        yield replace(chunk, is_done=False, finish_reason="", stats=None, error=None)
                    raise chunk.error
                yield chunk
            if is_done or not call.link.is_active():
                return
            attachment = None
        raise UnavailableError(f"request {request_id} keeps changing hands; retry")

    def _resolve(self, request_id: str, offset: int, call: CallContext
                 ) -> tuple[_Attachment | None, RequestRecord | None]:
        """A live run to observe (attached), or a stored record to read."""
        for _ in range(4):
            live = self.registry.get(request_id)
            if live is not None:
                attachment = _Attachment.hold(live, call.link, request_id)
                if attachment is not None:
                    num_tokens = live.num_tokens_of(attachment.index)
                    if offset > num_tokens:
                        attachment.close()
                        raise UserError(f"token_offset: {offset} is past the {num_tokens} tokens generated")
                    return attachment, None
                live.join(2.0)  # it is ending: wait for its final state in the store
                continue
            rec = self.store.get_request(request_id)
            if rec is None:
                raise NotFoundError(f"request_id: unknown request {request_id!r}")
            if offset > len(rec.generated_ids):
                raise UserError(f"token_offset: {offset} is past the {len(rec.generated_ids)} tokens generated")
            if rec.is_terminal or self._is_running_elsewhere(rec):
                return None, rec
            attachment = self._continue(rec, call)
            if attachment is not None:
                return attachment, None
        raise UnavailableError(f"request {request_id} keeps changing hands; retry")

    def _is_running_elsewhere(self, rec: RequestRecord) -> bool:
        return rec.status == RUNNING and rec.owner != self.cfg.gateway_id and not self._owner_is_gone(rec)

    def _continue(self, rec: RequestRecord, call: CallContext) -> _Attachment | None:
        """Takes over an interrupted (or orphaned) request and continues it with a new verifier call."""
        run = RequestRun(self._plan(rec, call), self.deps)
        existing = self.registry.add(run, call.deadline_s)
        if existing is not None:
            return _Attachment.hold(existing, call.link, rec.request_id)
        me, stale_before = self.cfg.gateway_id, time.time() - self.cfg.stale_after_s
        gone_owner = rec.owner if rec.status == RUNNING and self._owner_is_gone(rec) else None
        leased = "1" if self.is_leasing else "0"

        def claim(r: RequestRecord) -> dict | None:
            is_orphan = r.status == RUNNING and (r.owner in (me, gone_owner) or r.updated_at < stale_before)
            if r.status == INTERRUPTED or is_orphan:
                return {"status": RUNNING, "owner": me, "error": "", "leased": leased}
            return None

        try:
            _, is_claimed = self.store.update_request_if(rec.request_id, claim)
        except BaseException:
            self.registry.remove(run)
            raise
        if not is_claimed:
            self.registry.remove(run)
            return None
        call.on_event("continue", {"request_id": rec.request_id, "num_generated": len(rec.generated_ids)})
        attachment = _Attachment.hold(run, call.link)
        run.start()
        return attachment

    def _observe(self, attachment: _Attachment, since_tokens: int, since_chars: int | None, link: ClientLink
                 ) -> Iterator[Chunk]:
        run, index = attachment.run, attachment.index
        try:
            since_chars = run.text_len_at(since_tokens, index) if since_chars is None else since_chars
            while True:
                chunk = run.read(since_tokens, since_chars, POLL_S, index)
                if chunk is None:
                    if not link.is_active():
                        return
                    continue
                since_tokens, since_chars = chunk.num_tokens, chunk.num_chars
                yield chunk
                if chunk.is_done:
                    return
        finally:
            attachment.close()

    def _follow(self, rec: RequestRecord, since_tokens: int, since_chars: int | None, link: ClientLink
                ) -> Iterator[Chunk]:
        """Streams a stored request: its tail if it has ended, else its progress on another gateway."""
        params = GenerationParams.from_json(rec.params)
        state = TextState.replay(self.tokenizer, params.stop, rec.generated_ids[:since_tokens], params.stop_token_ids)
        since_chars = state.visible_lens[state.num_tokens] if since_chars is None else since_chars
        while True:
            ids = rec.generated_ids
            for t in ids[state.num_tokens:]:
                if state.is_stopped or state.push(t):
                    break
            n = len(ids)
            if rec.is_terminal:
                delta, num_chars = rec.text[since_chars:], len(rec.text)
            else:
                k = min(n, state.num_tokens)
                delta, num_chars = state.text_since(since_chars, k), state.visible_lens[k]
            error = RuntimeError(f"request failed: {rec.error}") if rec.status == "failed" else None
            if rec.is_terminal or n > since_tokens:
                yield Chunk(rec.request_id, tuple(ids[since_tokens:]), since_tokens, delta, n,
                            max(num_chars, since_chars), rec.is_terminal, rec.status, rec.finish_reason,
                            rec.stats if rec.is_terminal else None, error)
                since_tokens, since_chars = n, max(num_chars, since_chars)
            if rec.is_terminal or not self._is_running_elsewhere(rec) or not link.is_active():
                return
            time.sleep(FOLLOW_POLL_S)
            rec = self.store.get_request(rec.request_id) or rec

    # -- cancel, state, sessions, info ---------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        check_id(request_id)
        live = self.registry.get(request_id)
        if live is not None:
            index = live.index_of(request_id)
            is_cancelled = live.cancel(index)
            live.wait_ended(index, 1.0)
            if is_cancelled:
                return True
        rec = self.store.get_request(request_id)
        if rec is None:
            raise NotFoundError(f"request_id: unknown request {request_id!r}")
        me, stale_before = self.cfg.gateway_id, time.time() - self.cfg.stale_after_s
        gone_owner = rec.owner if rec.status == RUNNING and self._owner_is_gone(rec) else None

        def decide(r: RequestRecord) -> dict | None:
            if r.is_terminal:
                return None
            if r.status == RUNNING and r.owner not in (me, gone_owner) and r.updated_at >= stale_before:
                return {"cancel_requested": "1"}  # its gateway stops it at the next step
            return {"status": "cancelled", "finish_reason": "cancelled", "cancel_requested": "1"}

        rec, is_applied = self.store.update_request_if(request_id, decide)
        if rec is None:
            raise NotFoundError(f"request_id: unknown request {request_id!r}")
        return is_applied

    def get_request(self, request_id: str) -> RequestRecord:
        check_id(request_id)
        rec = self.store.get_request(request_id)
        if rec is None:
            raise NotFoundError(f"request_id: unknown request {request_id!r}")
        return rec

    def create_session(self, prefix: str) -> str:
        check_text_size(prefix, "prefix", self.limits)  # before the tokenizer sees it
        history = encode_turn(self.tokenizer, prefix, False) if prefix else ()
        if len(history) > self.limits.max_prompt_tokens:
            raise UserError(f"prefix: {len(history)} tokens, more than "
                            f"max_prompt_tokens={self.limits.max_prompt_tokens}")
        session_id = uuid.uuid4().hex
        self.store.put_session(SessionRecord(session_id, history, prefix))
        return session_id

    def delete_session(self, session_id: str, metadata: tuple[tuple[str, str], ...]) -> bool:
        check_id(session_id, "session_id")
        is_deleted = self.store.delete_session(session_id)
        try:
            self.verifier.release_session(session_id, 2.0, list(metadata))
        except Exception as exc:  # noqa: BLE001 - best effort: the verifier's cache also evicts on its own
            log.warning("session %s: verifier ReleaseSession failed: %s", session_id, exc)
        return is_deleted

    def verifier_info(self, metadata: tuple[tuple[str, str], ...]) -> VerifierSummary:
        return self.verifier.info(2.0, list(metadata))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Interrupts every run (they stay resumable), waits briefly for their final states, and
        gives up the lease so that other gateways need not wait for it to lapse."""
        runs = self.registry.all()
        for run in runs:
            run.interrupt()
        deadline = time.monotonic() + timeout_s
        for run in runs:
            run.join(max(0.0, deadline - time.monotonic()))
        if self._lease_thread is not None:
            self._lease_stop.set()
            self._lease_thread.join(1.0)
            try:
                self.store.drop_lease(self.cfg.gateway_id)
            except UnavailableError as exc:
                log.warning("could not drop this gateway's lease: %s", exc)
