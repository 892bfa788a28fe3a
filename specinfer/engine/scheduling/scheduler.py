"""The verifier's scheduler: continuous batching of prefills and tree verifications.

SpecInfer (Section 5) verifies the token trees of many requests in one LLM pass. Each iteration
here gathers the pending work of every active request: tree verifications (a one-node tree is
plain decoding) and prompt prefills, read in chunks under a per-iteration token budget so one
long prompt does not stall everyone; all of it runs as ONE forward pass. Requests join and leave
between iterations.

KV memory: a request is admitted only once the blocks for its whole worst case (prompt, new
tokens, the largest tree it may verify) are reserved, so nothing runs out of memory mid-request
and the allocator never fragments into failure under its budget. The prompt's leading full blocks
that the prefix cache holds (`blocks.BlockAllocator.match`) are adopted instead of computed, and
credited against the reservation. Blocks nobody holds stay cached until an allocation evicts them
(least recently freed first); when memory is still short, new requests wait in a bounded queue,
and get RESOURCE_EXHAUSTED when it is full or their wait times out. Every exit path frees the
blocks.

One mechanism serves every reuse: a multi-turn session's next turn, the samples of one request
(a prefix group: the others wait for the first to have read the prompt, then adopt its blocks)
and unrelated requests with a common prefix. With prefix caching off, blocks are shared only
within one session or one prefix group (their own cache namespace).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from specinfer import limits
from specinfer.engine.scheduling.blocks import BlockHash, block_hash, cache_root
from specinfer.engine.verification.sampling import SamplingNoise
from specinfer.engine.drafting.tree import TokenTree
from specinfer.engine.verification.verifier import LLMState, Verifier
from specinfer.engine.scheduling.workers import BatchWorker, Job, WorkerMetrics
from specinfer.errors import CapacityError, UnavailableError
from specinfer.params import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = limits.DEFAULT_MAX_BATCH
    token_budget: int = limits.DEFAULT_TOKEN_BUDGET  # tokens per forward pass, trees first, then prompt chunks
    min_prefill_chunk: int = 32  # a prompt always advances by at least this much
    max_waiting: int = limits.DEFAULT_MAX_WAITING  # requests queued for KV memory before RESOURCE_EXHAUSTED
    admission_timeout_s: float = limits.DEFAULT_ADMISSION_TIMEOUT_S
    max_sessions: int = limits.DEFAULT_MAX_SESSIONS
    is_prefix_caching: bool = limits.DEFAULT_IS_PREFIX_CACHING


@dataclass
class VerifySession:
    """One admitted request's LLM-side state."""

    state: LLMState
    session_id: str | None
    num_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    last_batch_size: int = 0  # requests verified in the same pass as this one's last step
    group: PrefixGroup | None = None  # its prefix group, until it has shared the leader's prompt (or gave up)


@dataclass
class PrefixGroup:
    """Requests that share their common prompt's KV (the samples of one request): the first one
    admitted (the leader) reads the prompt; each other member waits (PREFIX_GROUP_WAIT_S at most) for
    the leader to have committed the full blocks of the prompt they share, then holds those
    blocks too and reads only the rest (under one block) itself."""

    key: str
    leader: VerifySession
    prompt_ids: list[int]
    member_prompt_ids: list[int]
    wait_until: float


class Scheduler:
    """Owns the LLM runner; every model call goes through its worker. In the verifier service,
    request threads submit and one thread runs the passes (its own, or the main thread calling
    `run()`); the in-process engine drives it inline (`is_inline`, `pump`)."""

    def __init__(self, verifier: Verifier, cfg: SchedulerConfig = SchedulerConfig(),
                 metrics: WorkerMetrics | None = None, is_threaded: bool = True, is_inline: bool = False):
        self.verifier = verifier
        self.runner = verifier.runner
        self.cfg = cfg
        self.sessions: OrderedDict[str, list[BlockHash]] = OrderedDict()  # a session's cached blocks, LRU first
        self.cache_stats = PrefixCacheStats()
        self.leaders: dict[str, tuple[VerifySession, list[int]]] = {}  # prefix group -> its leader and prompt
        self.metrics = metrics
        self.num_open = 0
        self.cost_model = None  # a CostModel to keep current with measured passes (load-aware policy)
        if metrics is not None:
            self.runner.on_forward = metrics.iteration_tokens.observe
        self.worker = BatchWorker("verifier-worker", self._process, cfg.max_batch, metrics, is_threaded, is_inline)

    # ---- API for request handlers (any thread) ---------------------------------------------

    def open(self, prompt_ids: list[int], session_id: str | None, num_slots: int,
             timeout_s: float | None = None, prefix_group: str | None = None) -> VerifySession:
        """Admits a request once `num_slots` cache slots (its worst case) are reserved."""
        wait_s = self.cfg.admission_timeout_s if timeout_s is None else min(timeout_s, self.cfg.admission_timeout_s)
        return self.worker.call("open", prompt_ids, session_id, num_slots, time.monotonic() + wait_s, prefix_group)

    def run_drafting(self, build: Callable[[], Any]) -> Any:
        """Runs `build` (a co-located pool's tree building) on the model's thread and returns what
        it returns: one thread, one OpenMP team for every model of the process, none spinning
        against another between passes."""
        if self.worker.is_inline:
            return build()
        return self.worker.call("draft", build)

    def verify(self, session: VerifySession, tree: TokenTree, params: SamplingParams,
               noise: SamplingNoise | None) -> Future:
        return self.worker.submit("verify", session, tree, params, noise)

    def close(self, session: VerifySession) -> None:
        """Frees the request's KV; its full committed blocks stay cached for later requests."""
        try:
            self.worker.call("close", session)
        except UnavailableError:  # shutting down: the whole cache goes with the process
            pass

    def release_session(self, session_id: str) -> bool:
        return self.worker.call("release_session", session_id)

    def reset_prefix_cache(self) -> int:
        """Evicts every cached block no running request holds (a benchmark's cold start)."""
        return self.worker.call("reset_prefix_cache")

    def pump(self, futures: list[Future]) -> None:
        """Runs passes on this thread until `futures` are done (an unthreaded scheduler)."""
        self.worker.pump(futures)

    def run(self) -> None:
        """The worker loop, on this thread, until `stop` (see `BatchWorker.run`)."""
        self.worker.run()

    def stop(self) -> None:
        self.worker.stop()

    # ---- the worker thread -----------------------------------------------------------------

    def _process(self, jobs: list[Job]) -> tuple[list[Job], bool]:
        carried, is_busy = self._iterate(jobs)
        if self.metrics is not None:
            self.metrics.observe_kv(self.runner.allocator.num_used, self.runner.allocator.num_free)
            self.metrics.requests_running.set(self.num_open)
        return carried, is_busy

    def _iterate(self, jobs: list[Job]) -> tuple[list[Job], bool]:
        by_kind: dict[str, list[Job]] = {"open": [], "verify": [], "close": [], "release_session": [], "draft": [],
                                         "reset_prefix_cache": []}
        for job in jobs:
            by_kind[job.kind].append(job)
        for job in by_kind["draft"]:  # a co-located pool's trees, on this thread too (`run_drafting`)
            _settle(job, job.args[0])
        for job in by_kind["close"]:  # free memory before admitting anyone
            _settle(job, lambda: self._close(*job.args))
        for job in by_kind["release_session"]:
            _settle(job, lambda: self._release(job.args[0]))
        for job in by_kind["reset_prefix_cache"]:
            _settle(job, self.runner.allocator.forget_all)
        waiting = self._admit(by_kind["open"])
        prefilling, did_run = self._run_step(by_kind["verify"])
        is_busy = did_run or bool(by_kind["close"] or by_kind["release_session"] or by_kind["draft"]
                                  or by_kind["reset_prefix_cache"])
        return waiting + prefilling, is_busy

    def _admit(self, opens: list[Job]) -> list[Job]:
        """Admits in arrival order; returns the jobs that keep waiting for memory."""
        waiting = []
        now = time.monotonic()
        for job in opens:
            prompt_ids, session_id, num_slots, deadline, prefix_group = job.args
            if waiting or not self._try_admit(job, prompt_ids, session_id, num_slots, prefix_group):
                if now > deadline:
                    job.future.set_exception(CapacityError("KV cache full: timed out waiting for memory"))
                elif len(waiting) >= self.cfg.max_waiting:
                    job.future.set_exception(CapacityError("KV cache full and the admission queue is full"))
                else:
                    waiting.append(job)
        return waiting

    def _try_admit(self, job: Job, prompt_ids: list[int], session_id: str | None, num_slots: int,
                   prefix_group: str | None = None) -> bool:
        allocator = self.runner.allocator
        block_size = allocator.block_size
        num_blocks = -(-num_slots // block_size)
        if num_blocks > allocator.num_blocks:
            job.future.set_exception(CapacityError(
                f"request needs {num_slots} KV slots; the cache holds {allocator.num_blocks * block_size}"))
            return True
        root = self._cache_root(session_id, prefix_group)
        hits, digests = allocator.match(root, prompt_ids[:-1]) if root is not None else ([], [])  # >= 1 token pending
        num_idle_hits = sum(allocator.is_idle(b) for b in hits)  # free now, held once adopted
        if num_blocks - len(hits) > allocator.num_free - num_idle_hits:
            return False
        state = self.verifier.start(prompt_ids, root)
        num_cached = state.seq.adopt(hits, digests, prompt_ids) if hits else 0
        state.pending = list(prompt_ids[num_cached:])
        state.seq.ensure_capacity(num_slots)
        session = VerifySession(state, session_id, num_reused=num_cached)
        self._observe_cache(len(prompt_ids), num_cached)
        if prefix_group:
            self._join_group(session, prefix_group, prompt_ids)
        elif root is not None:
            self._follow_or_lead(session, prompt_ids, digests)
        self.num_open += 1
        job.future.set_result(session)
        return True

    def _observe_cache(self, num_queried: int, num_hit: int) -> None:
        self.cache_stats.observe(num_queried, num_hit)
        if self.metrics is not None:
            self.metrics.observe_prefix_cache(num_queried, num_hit)

    def _cache_root(self, session_id: str | None, prefix_group: str | None) -> BlockHash | None:
        """The cache namespace of a request: every request's, with prefix caching; else only its
        session's or its prefix group's; None: its KV is not cached."""
        if self.cfg.is_prefix_caching:
            return cache_root()
        if session_id:
            return cache_root("session:" + session_id)
        if prefix_group:
            return cache_root("group:" + prefix_group)
        return None

    def _run_step(self, verifies: list[Job]) -> tuple[list[Job], bool]:
        """One forward pass: every ready tree, plus prompt chunks under the token budget."""
        budget = self.cfg.token_budget
        ready, chunks, carried = [], [], []
        verifies = [job for job in verifies if self._fits_reservation(job)]
        is_ready = [self._share_prefix(job.args[0]) for job in verifies]
        carried = [job for job, ok in zip(verifies, is_ready) if not ok]  # group members waiting for their leader
        verifies = [job for job, ok in zip(verifies, is_ready) if ok]
        for job in verifies:  # requests past their prompt: trees cost their node count
            session, tree = job.args[0], job.args[1]
            if len(session.state.pending) == 1:
                ready.append(job)
                budget -= len(tree)
        for job in verifies:
            session, tree = job.args[0], job.args[1]
            num_chain = len(session.state.pending) - 1
            if num_chain == 0:
                continue
            if num_chain + len(tree) <= max(budget, 0):  # the rest of the prompt and the tree fit
                ready.append(job)
                budget -= num_chain + len(tree)
                continue
            chunk = min(num_chain, max(budget, self.cfg.min_prefill_chunk if not chunks else 0))
            if chunk > 0:
                chunks.append((session.state, chunk))
                budget -= chunk
            carried.append(job)
        if not ready and not chunks:
            return carried, False
        items = [(j.args[0].state, j.args[1], j.args[2], j.args[3]) for j in ready]
        started = time.perf_counter()
        results = self.verifier.step(items, chunks)
        if self.cost_model is not None:
            num_tokens = sum(n for _, n in chunks) + sum(len(s.pending) - 1 + len(t) for s, t, _, _ in items)
            self.cost_model.observe(num_tokens, time.perf_counter() - started)
        for job, result in zip(ready, results):
            job.args[0].last_batch_size = len(ready)
            if isinstance(result, Exception):  # that request fails alone; its neighbours go on
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        return carried, True

    @staticmethod
    def _fits_reservation(job: Job) -> bool:
        """A tree must fit the slots reserved at admission (no allocation mid-request)."""
        state, tree = job.args[0].state, job.args[1]
        if state.seq.num_committed + len(state.pending) - 1 + len(tree) <= state.seq.capacity:
            return True
        job.future.set_exception(CapacityError(f"a tree of {len(tree)} nodes exceeds the request's reserved KV"))
        return False

    def _follow_or_lead(self, session: VerifySession, prompt_ids: list[int], cached: list[BlockHash]) -> None:
        """Requests that arrive together with a common prefix read it once: when a running request
        is still reading the first full block this one lacks, this one follows it (a prefix group
        of its own); otherwise it leads for each full block of its prompt it will compute."""
        size = self.runner.allocator.block_size
        parent = cached[-1] if cached else session.state.seq.root
        keys = []
        for start in range(len(cached) * size, len(prompt_ids) - size, size):  # full blocks, >= 1 token pending
            parent = block_hash(parent, prompt_ids[start:start + size])
            keys.append("prefix:" + parent.hex())
        if not keys:
            return
        leader = self.leaders.get(keys[0])
        if leader is not None and not leader[0].state.seq.is_freed:
            session.group = PrefixGroup(keys[0], leader[0], leader[1], list(prompt_ids),
                                        time.monotonic() + limits.PREFIX_GROUP_WAIT_S)
            return
        for key in keys:
            self.leaders.setdefault(key, (session, list(prompt_ids)))

    def _join_group(self, session: VerifySession, key: str, prompt_ids: list[int]) -> None:
        leader = self.leaders.get(key)
        if leader is None:
            self.leaders[key] = (session, list(prompt_ids))
        else:
            session.group = PrefixGroup(key, leader[0], leader[1], list(prompt_ids), time.monotonic() + limits.PREFIX_GROUP_WAIT_S)

    def _share_prefix(self, session: VerifySession) -> bool:
        """False while a group member waits for its leader to read the prompt; then adopts the
        cached blocks of the prompt they share."""
        group = session.group
        if group is None:
            return True
        block_size = self.runner.allocator.block_size
        common = 0
        limit = min(len(group.prompt_ids), len(group.member_prompt_ids) - 1)  # keep >= 1 pending token
        while common < limit and group.prompt_ids[common] == group.member_prompt_ids[common]:
            common += 1
        num_blocks = common // block_size
        leader = group.leader.state.seq
        is_leader_gone = self.leaders.get(group.key, (None,))[0] is not group.leader or leader.is_freed
        state = session.state
        if state.seq.num_committed >= num_blocks * block_size:  # the cache already gave it as much
            session.group = None
            return True
        if not is_leader_gone and leader.num_committed < num_blocks * block_size and time.monotonic() < group.wait_until:
            return False  # the leader is still reading the prompt
        session.group = None
        before = state.seq.num_committed
        if before == len(state.seq.digests) * block_size:  # nothing computed past its cached blocks yet
            hits, digests = self.runner.allocator.match(state.seq.root, group.member_prompt_ids[:common])
            if len(hits) * block_size > before:
                session.num_reused = state.seq.adopt(hits, digests, group.member_prompt_ids)
                state.pending = state.pending[session.num_reused - before:]
                self._observe_cache(0, session.num_reused - before)
        return True

    def _close(self, session: VerifySession) -> None:
        self.num_open -= 1
        for key, (leader, _) in list(self.leaders.items()):
            if leader is session:
                del self.leaders[key]
        seq = session.state.seq
        if session.session_id and seq.digests:  # what `release_session` may evict by name
            self.sessions.pop(session.session_id, None)
            self.sessions[session.session_id] = list(seq.digests)
            while len(self.sessions) > self.cfg.max_sessions:
                self.sessions.popitem(last=False)
        self.verifier.release(session.state)

    def _release(self, session_id: str) -> bool:
        """Evicts the session's cached blocks that no running request holds."""
        digests = self.sessions.pop(session_id, None)
        if digests is None:
            return False
        self.runner.allocator.forget(digests)
        return True


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and those found (vLLM's queries and hits)."""

    num_queries: int = 0
    num_hits: int = 0

    def observe(self, num_queried: int, num_hit: int) -> None:
        self.num_queries += num_queried
        self.num_hits += num_hit


def _settle(job: Job, fn) -> None:
    try:
        job.future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - the error belongs to this job's caller
        job.future.set_exception(exc)
