"""KV-cache bookkeeping in plain Python: a block allocator with a prefix cache, and per-sequence
block tables.

SpecInfer (Section 4.2, "tree-based parallel decoding") writes a token tree's keys and values
after the committed prefix, then keeps only the accepted path. Here a sequence owns a list of
fixed-size blocks; slot `i` of the sequence lives at `block_table[i // block_size] * block_size +
i % block_size` in the preallocated cache. No tensors live here, so this is unit-tested fast.

Prefix caching. A block whose slots are all committed is addressed by a hash of its tokens and of
everything before them (the chain of its predecessors' hashes, as vLLM's automatic prefix caching
does): a later request whose prompt starts with the same tokens holds those blocks too (reference
counts) instead of computing them again. Only committed KV is ever addressed; a tree's scratch
rows never are. A shared block lies wholly inside every holder's committed prefix, which is never
written again, so no copy is made. A block nobody holds keeps its content while memory lasts:
allocation takes never-used blocks first, then evicts cached ones, least recently freed first.
A block in use is never evicted.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict

from specinfer.errors import CapacityError

BlockHash = bytes


def block_hash(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """The address of a full block: SHA-256 over its predecessors' hash and its tokens."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def cache_root(namespace: str = "") -> BlockHash:
    """The hash the first block of a sequence chains from. Requests share blocks only within one
    namespace: "" for every request (automatic prefix caching), or one session's or one request's
    own when prefix caching is off."""
    return hashlib.sha256(b"specinfer-kv:" + namespace.encode()).digest()


class BlockAllocator:
    """Hands out block ids, never-used ones lowest first (a lone sequence gets contiguous slots),
    then evicts cached free blocks, least recently freed first. A block is free again once every
    holder has freed it; it stays addressable by its hash until it is evicted."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap of free blocks holding nothing addressable
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free but addressable, LRU first
        self._refs = [0] * num_blocks  # holders of each block
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never used, or cached but held by nobody."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks addressable by their hash (held or not)."""
        return len(self._by_hash)

    def allocate(self, num: int) -> list[int]:
        if num > self.num_free:
            raise CapacityError(f"KV cache full: need {num} blocks, {self.num_free} free of {self.num_blocks}")
        blocks = []
        for _ in range(num):
            if self._free:
                block = heapq.heappop(self._free)
            else:  # evict the least recently freed cached block
                block, _ = self._cached_free.popitem(last=False)
                del self._by_hash[self._hash[block]]
                self._hash[block] = None
                self.num_evicted += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (held, or cached and free)."""
        for b in blocks:
            if not self._refs[b]:
                if b not in self._cached_free:
                    raise ValueError(f"sharing free KV block {b}")
                del self._cached_free[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one holder of each block. Freed in reverse, so a sequence's last blocks (the
        least likely to be shared) are evicted before its first ones."""
        for b in reversed(blocks):
            if not self._refs[b]:
                raise ValueError(f"double free of KV block {b}")
            self._refs[b] -= 1
            if not self._refs[b]:
                if self._hash[b] is None:
                    heapq.heappush(self._free, b)
                else:
                    self._cached_free[b] = None

    def register(self, block: int, digest: BlockHash) -> None:
        """Makes a held block, now full of committed KV, addressable by `digest`. A second block
        with the same content stays private (the first one is what lookups find)."""
        if not self._refs[block]:
            raise ValueError(f"registering free KV block {block}")
        if self._hash[block] is None and digest not in self._by_hash:
            self._hash[block] = digest
            self._by_hash[digest] = block

    def lookup(self, digest: BlockHash) -> int | None:
        return self._by_hash.get(digest)

    def is_idle(self, block: int) -> bool:
        """True for a cached block that nobody holds (an allocation could evict it)."""
        return block in self._cached_free

    def match(self, root: BlockHash, token_ids: list[int]) -> tuple[list[int], list[BlockHash]]:
        """The cached blocks that hold the leading full blocks of `token_ids`, and their hashes:
        the longest run that is cached."""
        blocks, digests, parent = [], [], root
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = block_hash(parent, token_ids[start:start + size])
            block = self._by_hash.get(parent)
            if block is None:
                break
            blocks.append(block)
            digests.append(parent)
        return blocks, digests

    def forget_all(self) -> int:
        """Evicts every cached block nobody holds; returns how many."""
        return self.forget([self._hash[b] for b in list(self._cached_free)])

    def forget(self, digests: list[BlockHash]) -> int:
        """Evicts the blocks with these hashes that nobody holds now; returns how many."""
        num = 0
        for digest in digests:
            block = self._by_hash.get(digest)
            if block is not None and block in self._cached_free:
                del self._cached_free[block]
                del self._by_hash[digest]
                self._hash[block] = None
                heapq.heappush(self._free, block)
                num += 1
        return num


class SequenceKV:
    """One sequence's view of the cache: its block table and how many slots are committed.

    Slots [0, num_committed) hold the verified prefix. Slots past it are scratch space for the
    token tree of the current step; `advance` (or the runner's `commit`) makes the accepted ones
    permanent. A sequence with a cache `root` records its committed tokens and makes each block
    addressable once it is full; one without (`root=None`, a speculator's) is not cached.
    """

    def __init__(self, allocator: BlockAllocator, root: BlockHash | None = None):
        self.allocator = allocator
        self.root = root
        self.block_table: list[int] = []
        self.num_committed = 0
        self.is_freed = False
        self.token_ids: list[int] = []  # committed tokens, when cached
        self.digests: list[BlockHash] = []  # hashes of the leading full blocks, when cached

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.allocator.block_size

    def blocks_needed(self, num_slots: int) -> int:
        block_size = self.allocator.block_size
        return max(0, -(-num_slots // block_size) - len(self.block_table))

    def ensure_capacity(self, num_slots: int) -> None:
        """Grows the block table so that slots [0, num_slots) exist."""
        if self.is_freed:
            raise RuntimeError("sequence KV used after free")
        needed = self.blocks_needed(num_slots)
        if needed:
            self.block_table.extend(self.allocator.allocate(needed))

    def slot(self, index: int) -> int:
        block_size = self.allocator.block_size
        return self.block_table[index // block_size] * block_size + index % block_size

    def slots(self, start: int, end: int) -> list[int]:
        return [self.slot(i) for i in range(start, end)]

    def contiguous_start(self, end: int) -> int | None:
        """First cache slot if slots [0, end) are one contiguous range, else None."""
        block_size = self.allocator.block_size
        num_blocks = -(-end // block_size)
        table = self.block_table
        if num_blocks == 0:
            return table[0] * block_size if table else 0
        first = table[0]
        for i in range(1, num_blocks):
            if table[i] != first + i:
                return None
        return first * block_size

    def advance(self, token_ids: list[int]) -> None:
        """Commits the next len(token_ids) slots, whose KV now holds `token_ids`; each block this
        fills becomes addressable."""
        self.num_committed += len(token_ids)
        if self.root is None:
            return
        self.token_ids.extend(token_ids)
        size = self.allocator.block_size
        while (len(self.digests) + 1) * size <= self.num_committed:
            start = len(self.digests) * size
            digest = block_hash(self.digests[-1] if self.digests else self.root, self.token_ids[start:start + size])
            self.allocator.register(self.block_table[len(self.digests)], digest)
            self.digests.append(digest)

    def adopt(self, blocks: list[int], digests: list[BlockHash], token_ids: list[int]) -> int:
        """Holds cached `blocks` (found by `BlockAllocator.match` for `token_ids`, from the first
        block on) as its leading blocks instead of computing them; returns the slots committed
        now. The sequence may already hold the first few of them (and nothing computed past
        them); own blocks they replace are freed."""
        size = self.allocator.block_size
        have = len(self.digests)
        if self.root is None or self.num_committed != have * size or list(digests[:have]) != self.digests:
            raise ValueError("only a cached sequence with nothing computed past its cached blocks adopts more")
        added = blocks[have:]
        self.allocator.share(added)
        own = self.block_table[have:len(blocks)]
        self.block_table[have:len(blocks)] = added
        self.allocator.free(own)
        self.digests = list(digests)
        self.num_committed = len(blocks) * size
        self.token_ids = list(token_ids[:self.num_committed])
        return self.num_committed

    def free(self) -> None:
        if not self.is_freed:
            self.allocator.free(self.block_table)
            self.block_table = []
            self.num_committed = 0
            self.is_freed = True
