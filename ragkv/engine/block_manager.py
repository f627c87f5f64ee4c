"""Accounting of paged KV blocks: a free list, reference counts and a content-hash index.

A block is one layer's ``block_size`` token rows (K and V) in the pool. Every layer of a sequence
has its own block table, so blocks are shared per layer: by identical prompt heads (hash index, as
vLLM's prefix caching) and by BFF/CFF fusion. A block returns to the free list exactly when its last
reference is dropped; dropping a reference to a free block is an error, never a silent no-op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockAccountingError(RuntimeError):
    """A block was freed more often than referenced, or used while free (a bug, never ignored)."""


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks for an allocation (the engine preempts, or waits, before that)."""


class BlockManager:
    """Reference-counted allocation of ``num_blocks`` physical KV blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_to_block: dict[Hashable, int] = {}
        self._block_hash: dict[int, Hashable] = {}
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with reference count 1 (all or none)."""
        if not 0 <= n <= len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def incref(self, block: int) -> None:
        """One more reference to an allocated block (sharing)."""
        if self._ref[block] <= 0:
            raise BlockAccountingError(f"incref of free block {block}")
        self._ref[block] += 1

    def free(self, block: int) -> bool:
        """Drop one reference; True when the block went back to the free list."""
        if self._ref[block] <= 0:
            raise BlockAccountingError(f"double free of block {block}")
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        self.unregister(block)
        self._free.append(block)
        return True

    # ---- content-hash index (exact sharing of identical prompt heads) ----------------------------
    def lookup(self, key: Hashable) -> int | None:
        """The live block registered under ``key``, if any."""
        return self._hash_to_block.get(key)

    def register(self, key: Hashable, block: int) -> None:
        """Index an allocated, full, immutable block under ``key`` (first writer wins)."""
        if self._ref[block] <= 0:
            raise BlockAccountingError(f"register of free block {block}")
        if key not in self._hash_to_block and block not in self._block_hash:
            self._hash_to_block[key] = block
            self._block_hash[block] = key

    def unregister(self, block: int) -> None:
        """Forget ``block``'s hash (freed, or its content changes: it hosts a fused representative)."""
        h = self._block_hash.pop(block, None)
        if h is not None:
            del self._hash_to_block[h]

    def check(self, references: dict[int, int]) -> None:
        """Assert the books balance against the live references ``{block: count}`` (tests, debugging)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockAccountingError("a block is on the free list twice")
        for b in range(self.num_blocks):
            want = references.get(b, 0)
            if self._ref[b] != want or (want == 0) != (b in free):
                raise BlockAccountingError(
                    f"block {b}: ref count {self._ref[b]}, {want} live references, free: {b in free}"
                )
