"""Request and session state, with TTLs: Redis when configured, an embedded in-memory store otherwise.

The gateway (SpecInfer Section 5's request manager) keeps every request's progress here, so that
GetRequest can read it and a streamed request can be resumed by id after a reconnect, a verifier
outage or a gateway restart. Records are flat string hashes; `Store` implements the domain
operations once, over four primitives that `RedisStore` and `MemoryStore` provide.

A running request's output grows by one write per verified step, and that write costs the step's
size, not the output's: the step's token ids and visible-text delta go into a field of their own,
`step:<token offset>`, beside the whole-state fields (`generated_ids`, `text`) that a request's
first and last writes set. A record reads as the whole state followed by the steps that continue
it. Writing a step twice (a retried round trip) rewrites the same field with the same value.

Redis errors become `UnavailableError` (gRPC UNAVAILABLE). redis-py reconnects per command, so
the gateway recovers by itself once Redis is back; short socket timeouts make an outage fail fast.
"""

from __future__ import annotations

import json
import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from specinfer.errors import UnavailableError
from specinfer.limits import DEFAULT_REQUEST_TTL_S, DEFAULT_SESSION_TTL_S
from specinfer.stats import GenerationStats
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

RUNNING, INTERRUPTED, FINISHED, CANCELLED, FAILED = "running", "interrupted", "finished", "cancelled", "failed"
TERMINAL_STATUSES = frozenset({FINISHED, CANCELLED, FAILED})

Hash = dict[str, str]
Decide = Callable[["Hash | None"], "Hash | None"]
STEP = "step:"  # a step's field: STEP + its token offset -> JSON [token ids, visible text delta]


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    status: str
    prompt: str  # the new turn's text
    session_id: str
    params: dict  # GenerationParams.to_json()
    prompt_ids: tuple[int, ...]  # full context sent to the verifier: session history + this turn
    generated_ids: tuple[int, ...] = ()
    text: str = ""  # visible text so far; the final text once terminal
    finish_reason: str = ""
    stats: GenerationStats | None = None  # set once the request has ended (or been interrupted)
    error: str = ""
    owner: str = ""  # id of the gateway whose worker drives it
    session_base_len: int = 0  # session history length this turn started from
    updated_at: float = 0.0
    is_cancel_requested: bool = False
    is_leased: bool = False  # its owner renews a liveness lease (`Store.renew_lease`)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class Progress:
    """A request's whole state, written in one round trip (a run's first and last writes)."""

    status: str
    generated_ids: tuple[int, ...]
    text: str
    finish_reason: str = ""
    stats: GenerationStats | None = None
    error: str = ""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    history_ids: tuple[int, ...]
    text: str


def _ids(text: str | None) -> tuple[int, ...]:
    return tuple(json.loads(text)) if text else ()


def _stats(text: str | None) -> GenerationStats | None:
    return GenerationStats.from_json(json.loads(text)) if text else None


def _progress_hash(request_id: str, p: Progress) -> Hash:
    h = {"request_id": request_id, "status": p.status, "generated_ids": json.dumps(list(p.generated_ids)),
         "text": p.text, "finish_reason": p.finish_reason, "error": p.error, "updated_at": repr(time.time())}
    if p.stats is not None:
        h["stats"] = json.dumps(p.stats.to_json())
    return h


def _output(h: Hash) -> tuple[tuple[int, ...], str]:
    """The token ids and text a hash holds: the whole state, then the steps that continue it."""
    ids, text = list(_ids(h.get("generated_ids"))), [h.get("text", "")]
    for offset, value in sorted((int(k[len(STEP):]), v) for k, v in h.items() if k.startswith(STEP)):
        if offset < len(ids):  # already in the whole state
            continue
        if offset > len(ids):  # a gap: nothing after it continues this output
            break
        step_ids, delta = json.loads(value)
        ids.extend(step_ids)
        text.append(delta)
    return tuple(ids), "".join(text)


def record_to_hash(r: RequestRecord) -> Hash:
    return {
        "request_id": r.request_id, "status": r.status, "prompt": r.prompt, "session_id": r.session_id,
        "params": json.dumps(r.params), "prompt_ids": json.dumps(list(r.prompt_ids)),
        "generated_ids": json.dumps(list(r.generated_ids)), "text": r.text, "finish_reason": r.finish_reason,
        "stats": json.dumps(r.stats.to_json()) if r.stats is not None else "", "error": r.error, "owner": r.owner,
        "session_base_len": str(r.session_base_len), "updated_at": repr(r.updated_at or time.time()),
        "cancel_requested": "1" if r.is_cancel_requested else "0", "leased": "1" if r.is_leased else "0",
    }


def hash_to_record(h: Hash) -> RequestRecord:
    generated_ids, text = _output(h)
    return RequestRecord(
        request_id=h["request_id"], status=h["status"], prompt=h.get("prompt", ""),
        session_id=h.get("session_id", ""), params=json.loads(h.get("params") or "{}"),
        prompt_ids=_ids(h.get("prompt_ids")), generated_ids=generated_ids,
        text=text, finish_reason=h.get("finish_reason", ""),
        stats=_stats(h.get("stats")), error=h.get("error", ""), owner=h.get("owner", ""),
        session_base_len=int(h.get("session_base_len") or 0), updated_at=float(h.get("updated_at") or 0),
        is_cancel_requested=h.get("cancel_requested") == "1", is_leased=h.get("leased") == "1",
    )


def _session_hash(s: SessionRecord) -> Hash:
    return {"session_id": s.session_id, "history_ids": json.dumps(list(s.history_ids)), "text": s.text}


def _hash_to_session(h: Hash) -> SessionRecord:
    return SessionRecord(h["session_id"], _ids(h.get("history_ids")), h.get("text", ""))


class Store(ABC):
    """Domain operations on request and session records; subclasses provide the four primitives."""

    def __init__(self, request_ttl_s: int, session_ttl_s: int, key_prefix: str = "specinfer:"):
        self.request_ttl_s = request_ttl_s
        self.session_ttl_s = session_ttl_s
        self.prefix = key_prefix

    # -- primitives -------------------------------------------------------------------------
    @abstractmethod
    def _read(self, key: str) -> Hash | None: ...

    @abstractmethod
    def _write(self, key: str, fields: Hash, ttl_s: int, read_field: str | None = None,
               drop: tuple[str, ...] = ()) -> str | None:
        """Sets fields, deletes the `drop` fields, sets the TTL and returns `read_field`'s value,
        in one round trip."""

    @abstractmethod
    def _cas(self, key: str, decide: Decide, ttl_s: int) -> tuple[Hash | None, bool]:
        """Atomically: reads the hash, asks `decide` for fields to set (None = leave it), sets them."""

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abstractmethod
    def ping(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook: only Redis holds connections
        """Releases connections."""

    # -- requests ---------------------------------------------------------------------------
    def _rkey(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _skey(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def _gkey(self, gateway_id: str) -> str:
        return f"{self.prefix}gateway:{gateway_id}"

    # -- gateway liveness ---------------------------------------------------------------------
    def renew_lease(self, gateway_id: str, ttl_s: float) -> None:
        """Marks `gateway_id` alive for the next `ttl_s` seconds (whole seconds, rounded up)."""
        self._write(self._gkey(gateway_id), {"alive": "1"}, max(1, math.ceil(ttl_s)))

    def has_lease(self, gateway_id: str) -> bool:
        return self._read(self._gkey(gateway_id)) is not None

    def drop_lease(self, gateway_id: str) -> None:
        self._delete(self._gkey(gateway_id))

    def create_request(self, record: RequestRecord) -> bool:
        """Stores a new record; False if the id is taken."""
        _, created = self._cas(self._rkey(record.request_id),
                               lambda cur: record_to_hash(record) if cur is None else None, self.request_ttl_s)
        return created

    def get_request(self, request_id: str) -> RequestRecord | None:
        h = self._read(self._rkey(request_id))
        return hash_to_record(h) if h and "status" in h else None

    def put_progress(self, request_id: str, progress: Progress, drop_steps: tuple[int, ...] = ()) -> bool:
        """Writes a request's whole state, deleting the step fields at `drop_steps` (the state holds
        them now); returns True if another gateway asked to cancel it."""
        key, fields = self._rkey(request_id), _progress_hash(request_id, progress)
        flag = self._write(key, fields, self.request_ttl_s, "cancel_requested", tuple(f"{STEP}{o}" for o in drop_steps))
        return flag == "1"

    def put_step(self, request_id: str, offset: int, ids: tuple[int, ...], text_delta: str) -> bool:
        """Appends one verified step to a running request's output: `ids` continue it at token
        `offset`, `text_delta` continues its visible text. Costs the step's size, not the output's.
        Returns True if another gateway asked to cancel it."""
        fields = {"status": RUNNING, "updated_at": repr(time.time())}
        if ids or text_delta:
            fields[f"{STEP}{offset}"] = json.dumps([list(ids), text_delta], ensure_ascii=False)
        return self._write(self._rkey(request_id), fields, self.request_ttl_s, "cancel_requested") == "1"

    def update_request_if(self, request_id: str, decide: Callable[[RequestRecord], Hash | None]
                          ) -> tuple[RequestRecord | None, bool]:
        """Compare-and-set on a record: `decide` sees the current record and returns fields or None."""
        def on_hash(cur: Hash | None) -> Hash | None:
            if not cur or "status" not in cur:
                return None
            new = decide(hash_to_record(cur))
            return None if new is None else {**new, "updated_at": repr(time.time())}

        cur, applied = self._cas(self._rkey(request_id), on_hash, self.request_ttl_s)
        return (hash_to_record(cur) if cur and "status" in cur else None), applied

    # -- sessions ---------------------------------------------------------------------------
    def put_session(self, session: SessionRecord) -> None:
        self._write(self._skey(session.session_id), _session_hash(session), self.session_ttl_s)

    def get_session(self, session_id: str) -> SessionRecord | None:
        h = self._read(self._skey(session_id))
        return _hash_to_session(h) if h and "session_id" in h else None

    def delete_session(self, session_id: str) -> bool:
        return self._delete(self._skey(session_id))

    def append_turn(self, session_id: str, base_len: int, new_ids: tuple[int, ...], new_text: str) -> bool:
        """Appends a finished turn if the history is still `base_len` tokens long (no lost update)."""
        def decide(cur: Hash | None) -> Hash | None:
            if not cur or "session_id" not in cur:
                return None
            s = _hash_to_session(cur)
            if len(s.history_ids) != base_len:
                return None
            return _session_hash(SessionRecord(session_id, s.history_ids + tuple(new_ids), s.text + new_text))

        return self._cas(self._skey(session_id), decide, self.session_ttl_s)[1]


class MemoryStore(Store):
    """The embedded default: one process, a lock, expiry on access plus a sweep once a minute."""

    SWEEP_EVERY_S = 60.0

    def __init__(self, request_ttl_s: int = DEFAULT_REQUEST_TTL_S, session_ttl_s: int = DEFAULT_SESSION_TTL_S,
                 key_prefix: str = "specinfer:"):
        super().__init__(request_ttl_s, session_ttl_s, key_prefix)
        self._lock = threading.Lock()
        self._data: dict[str, tuple[Hash, float]] = {}
        self._next_sweep = time.monotonic() + self.SWEEP_EVERY_S

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.SWEEP_EVERY_S
        for key in [k for k, (_, expires) in self._data.items() if expires < now]:
            del self._data[key]

    def _live(self, key: str) -> Hash | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._data[key]
            return None
        return entry[0]

    def _read(self, key):
        with self._lock:
            h = self._live(key)
            return dict(h) if h is not None else None

    def _write(self, key, fields, ttl_s, read_field=None, drop=()):
        with self._lock:
            self._sweep()
            h = self._live(key) or {}  # updated in place: reads copy, and a step costs its own size
            h.update(fields)
            for name in drop:
                h.pop(name, None)
            self._data[key] = (h, time.monotonic() + ttl_s)
            return h.get(read_field) if read_field else None

    def _cas(self, key, decide, ttl_s):
        with self._lock:
            cur = self._live(key)
            cur = dict(cur) if cur is not None else None
            new = decide(cur)
            if new is None:
                return cur, False
            self._data[key] = ({**(cur or {}), **new}, time.monotonic() + ttl_s)
            return cur, True

    def _delete(self, key):
        with self._lock:
            return self._live(key) is not None and self._data.pop(key, None) is not None

    def ping(self):
        pass


class RedisStore(Store):
    """Redis (redis-py) with fail-fast timeouts; every Redis error becomes UnavailableError."""

    MAX_CAS_ATTEMPTS = 32

    def __init__(self, url: str, request_ttl_s: int = DEFAULT_REQUEST_TTL_S,
                 session_ttl_s: int = DEFAULT_SESSION_TTL_S,
                 key_prefix: str = "specinfer:", timeout_s: float = 0.5):
        super().__init__(request_ttl_s, session_ttl_s, key_prefix)
        self._errors = redis.RedisError
        self._watch_error = redis.WatchError
        # One immediate retry replaces a pooled connection that died while Redis restarted.
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 1), decode_responses=True)
        self.url = url

    def _call(self, fn: Callable):
        try:
            return fn()
        except self._errors as exc:
            raise UnavailableError(f"request store (Redis) unavailable: {exc}") from exc

    def _read(self, key):
        return self._call(lambda: self.r.hgetall(key)) or None

    def _write(self, key, fields, ttl_s, read_field=None, drop=()):
        def run():
            p = self.r.pipeline(transaction=True)
            p.hset(key, mapping=fields)
            if drop:
                p.hdel(key, *drop)
            p.expire(key, ttl_s)
            if read_field:
                p.hget(key, read_field)
            out = p.execute()
            return out[-1] if read_field else None

        return self._call(run)

    def _cas(self, key, decide, ttl_s):
        def run():
            with self.r.pipeline() as p:
                for _ in range(self.MAX_CAS_ATTEMPTS):
                    try:
                        p.watch(key)
                        cur = p.hgetall(key) or None
                        new = decide(cur)
                        if new is None:
                            p.unwatch()
                            return cur, False
                        p.multi()
                        p.hset(key, mapping=new)
                        p.expire(key, ttl_s)
                        p.execute()
                        return cur, True
                    except self._watch_error:
                        continue
            raise UnavailableError(f"request store (Redis): {key} is too contended")

        return self._call(run)

    def _delete(self, key):
        return bool(self._call(lambda: self.r.delete(key)))

    def ping(self):
        self._call(self.r.ping)

    def close(self):
        self.r.close()


def make_store(redis_url: str | None, request_ttl_s: int, session_ttl_s: int, key_prefix: str) -> Store:
    if redis_url:
        return RedisStore(redis_url, request_ttl_s, session_ttl_s, key_prefix)
    return MemoryStore(request_ttl_s, session_ttl_s, key_prefix)
