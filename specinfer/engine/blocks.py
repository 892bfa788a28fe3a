"""KV-cache bookkeeping in plain Python: a block allocator and per-sequence block tables.

SpecInfer (Section 4.2, "tree-based parallel decoding") writes a token tree's keys and values
after the committed prefix, then keeps only the accepted path. Here a sequence owns a list of
fixed-size blocks; slot `i` of the sequence lives at `block_table[i // block_size] * block_size +
i % block_size` in the preallocated cache. No tensors live here, so this is unit-tested fast.

A block may be held by several sequences (reference counts): the samples of one request read
their common prompt's full blocks from the sequence that computed them. A shared block lies
wholly inside every holder's committed prefix, which is never written again, so no copy is made.
"""

from __future__ import annotations

import heapq

from specinfer.errors import CapacityError


class BlockAllocator:
    """Hands out block ids, lowest first, so a lone sequence gets contiguous slots. A block is
    free again once every holder has freed it."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap
        self._refs = [0] * num_blocks  # holders of each block

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise CapacityError(f"KV cache full: need {num} blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [heapq.heappop(self._free) for _ in range(num)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks`."""
        for b in blocks:
            if not self._refs[b]:
                raise ValueError(f"sharing free KV block {b}")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._refs[b]:
                raise ValueError(f"double free of KV block {b}")
            self._refs[b] -= 1
            if not self._refs[b]:
                heapq.heappush(self._free, b)


class SequenceKV:
    """One sequence's view of the cache: its block table and how many slots are committed.

    Slots [0, num_committed) hold the verified prefix. Slots past it are scratch space for the
    token tree of the current step; `commit` makes the accepted ones permanent.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_table: list[int] = []
        self.num_committed = 0
        self.is_freed = False

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

    def share_prefix(self, other: "SequenceKV", num_blocks: int) -> None:
        """Reads its first `num_blocks` blocks (committed, full) from `other` instead of holding its
        own: this sequence's own are freed, and its first num_blocks * block_size slots committed."""
        if self.num_committed or num_blocks > len(self.block_table) or other.num_committed < num_blocks * self.allocator.block_size:
            raise ValueError("a shared prefix must be committed in the source and not yet in this sequence")
        shared = other.block_table[:num_blocks]
        self.allocator.share(shared)
        self.allocator.free(self.block_table[:num_blocks])
        self.block_table[:num_blocks] = shared
        self.num_committed = num_blocks * self.allocator.block_size

    def trim(self, num_slots: int) -> None:
        """Frees blocks past those needed for `num_slots` slots."""
        keep = -(-num_slots // self.allocator.block_size)
        if keep < len(self.block_table):
            self.allocator.free(self.block_table[keep:])
            del self.block_table[keep:]

    def free(self) -> None:
        if not self.is_freed:
            self.allocator.free(self.block_table)
            self.block_table = []
            self.num_committed = 0
            self.is_freed = True
