"""Cache-aware routing: which verifier a request goes to.

A verifier reuses the KV of a prompt prefix it has already computed (its KV cache is paged in
blocks; a block is reusable when every token in it and before it is the same). So a request is
worth sending where its prompt's leading blocks were sent before. The gateway cannot see the
verifiers' caches; it remembers instead what it sent where:

- `block_hashes`: a prompt's full blocks, each hashed together with the hash of the block before
  it (a chain, as vLLM's prefix cache hashes them), so equal hashes mean equal prefixes.
- `PrefixIndex`: per verifier, the block hashes it was sent, bounded, least recently sent first
  out (as the verifier's own cache evicts).
- `Affinities`: sessions, each pinned to the verifier it went to (its KV is there), bounded
  the same way.
- `Router`: picks among the verifiers serving now. A pinned session goes to its verifier. Else
  the verifier holding the longest leading run of the prompt's blocks wins, unless it is much
  busier than the least loaded one (in-flight requests, more than `balance_abs` more and more
  than `balance_ratio` times as many: SGLang's cache-aware router's rule): then, and when no
  verifier holds any of the prompt, the least loaded takes it (of equals, the one sent the
  least). Each pick holds one unit of load until the call ends (`Route.release`).

Nothing here does I/O; the pool of verifiers (`verifier_pool.py`) says which are serving.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from specinfer.errors import UserError
from specinfer.limits import (
    DEFAULT_ROUTING_BALANCE_ABS, DEFAULT_ROUTING_BALANCE_RATIO, DEFAULT_ROUTING_INDEX_BLOCKS,
    DEFAULT_ROUTING_MAX_AFFINITIES,
)

# Why a verifier was picked (the `reason` label of the gateway's routing metric).
CACHE = "cache"  # it holds the longest leading run of the prompt's blocks
BALANCE = "balance"  # the least loaded: no verifier holds the prompt's start, or the best one is too busy
AFFINITY = "affinity"  # the request's session is there
REASONS = (CACHE, BALANCE, AFFINITY)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of `token_ids`, each covering its block and every token before it.
    A partial last block is not cached by the verifier either, so it is left out."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class RoutingConfig:
    balance_abs: int = DEFAULT_ROUTING_BALANCE_ABS
    balance_ratio: float = DEFAULT_ROUTING_BALANCE_RATIO
    index_blocks: int = DEFAULT_ROUTING_INDEX_BLOCKS  # per verifier
    max_affinities: int = DEFAULT_ROUTING_MAX_AFFINITIES

    def __post_init__(self):
        if self.balance_abs < 0:
            raise UserError(f"routing balance threshold: must be >= 0 requests, got {self.balance_abs}")
        if self.balance_ratio < 1:
            raise UserError(f"routing balance ratio: must be >= 1, got {self.balance_ratio}")
        if self.index_blocks < 1 or self.max_affinities < 1:
            raise UserError("routing index and affinity bounds must be >= 1")


class PrefixIndex:
    """The block hashes one verifier was sent, at most `capacity`, least recently sent evicted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` it holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Affinities:
    """Keys (sessions) pinned to a verifier, at most `capacity`, least recently used out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        return self._where.get(key)

    def pin(self, key: str, address: str) -> None:
        self._where[key] = address
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, key: str) -> str | None:
        return self._where.pop(key, None)


@dataclass(frozen=True)
class Candidate:
    """A verifier that may take a request: its address and the KV block size it reported."""

    address: str
    block_size: int


class Route:
    """One pick: where, why, how many of the prompt's blocks it holds; `release` when the call ends."""

    def __init__(self, router: "Router", address: str, reason: str, matched_blocks: int, block_size: int):
        self.address, self.reason = address, reason
        self.matched_tokens = matched_blocks * block_size
        self._router = router
        self._is_released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._is_released:
                return
            self._is_released = True
        self._router._finish(self.address)


class Router:
    """Picks a verifier per call (see the module's doc), and counts each one's calls in flight."""

    def __init__(self, cfg: RoutingConfig | None = None):
        self.cfg = cfg or RoutingConfig()
        self._lock = threading.Lock()
        self._indexes: dict[str, PrefixIndex] = {}
        self._loads: dict[str, int] = {}
        self._affinities = Affinities(self.cfg.max_affinities)
        self._picked_at: dict[str, int] = {}  # the pick number each verifier was last picked at
        self._num_picks = 0

    def load(self, address: str) -> int:
        with self._lock:
            return self._loads.get(address, 0)

    def route(self, prompt_ids: Sequence[int], candidates: Sequence[Candidate], affinity_key: str = "") -> Route:
        """The verifier among `candidates` (non-empty) this prompt should go to. With an
        `affinity_key` (a session), the first pick pins the key to its verifier
        and later ones go there while it is a candidate."""
        if not candidates:
            raise ValueError("no candidate verifier")
        by_address = {c.address: c for c in candidates}
        hashes_by_size: dict[int, list[int]] = {}
        with self._lock:
            pinned = self._affinities.get(affinity_key) if affinity_key else None
            matches = {}
            for c in candidates:
                hashes = hashes_by_size.get(c.block_size)
                if hashes is None:
                    hashes = hashes_by_size[c.block_size] = block_hashes(prompt_ids, c.block_size)
                index = self._indexes.get(c.address)
                matches[c.address] = index.match(hashes) * c.block_size if index is not None else 0
            if pinned in by_address:
                address, reason = pinned, AFFINITY
            else:
                address, reason = self._pick(candidates, matches)
            chosen = by_address[address]
            index = self._indexes.get(address)
            if index is None:
                index = self._indexes[address] = PrefixIndex(self.cfg.index_blocks)
            index.add(hashes_by_size[chosen.block_size])
            self._loads[address] = self._loads.get(address, 0) + 1
            self._num_picks += 1
            self._picked_at[address] = self._num_picks
            if affinity_key:
                self._affinities.pin(affinity_key, address)
        return Route(self, address, reason, matches[address] // chosen.block_size, chosen.block_size)

    def _pick(self, candidates: Sequence[Candidate], matched_tokens: dict[str, int]) -> tuple[str, str]:
        # The least loaded; among equals the one sent the least (most room in its cache, as SGLang
        # picks the smallest tree), then the one picked longest ago (prompts shorter than a block
        # leave no trace: they take turns), then the earlier candidate (the pool's order is stable).
        order = {c.address: i for i, c in enumerate(candidates)}
        least = min(candidates, key=lambda c: (self._loads.get(c.address, 0), self._size(c.address),
                                               self._picked_at.get(c.address, -1), order[c.address])).address
        best = max(candidates, key=lambda c: (matched_tokens[c.address], -self._loads.get(c.address, 0),
                                              -order[c.address])).address
        if matched_tokens[best] == 0:
            return least, BALANCE
        best_load, least_load = self._loads.get(best, 0), self._loads.get(least, 0)
        if best_load > least_load + self.cfg.balance_abs and best_load > least_load * self.cfg.balance_ratio:
            return least, BALANCE
        return best, CACHE

    def _size(self, address: str) -> int:
        index = self._indexes.get(address)
        return len(index) if index is not None else 0

    def forget_affinity(self, key: str) -> str | None:
        """Unpins a session (deleted); returns the verifier it was on, if known."""
        with self._lock:
            return self._affinities.forget(key)

    def affinity(self, key: str) -> str | None:
        with self._lock:
            return self._affinities.get(key)

    def drop(self, address: str) -> None:
        """Forgets what a verifier holds: it restarted (its cache is empty) or left."""
        with self._lock:
            self._indexes.pop(address, None)

    def _finish(self, address: str) -> None:
        with self._lock:
            self._loads[address] = max(0, self._loads.get(address, 0) - 1)
