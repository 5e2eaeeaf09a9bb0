"""KV memory: a pool of fixed-size blocks and a block table per request.

The runner keeps every layer's keys and values in one big array of token positions,
``[num_blocks * block_size, kv_heads, head_dim]`` (``runner.KVPool``). A request owns a
list of blocks (its *block table*); its token number ``i`` lives at flat address
``table[i // block_size] * block_size + i % block_size`` (``Chunk.kv_addresses``). This
module is the bookkeeping only, in pure Python: the scheduler is its one user. Joining a batch therefore
costs only taking free blocks from a list, and leaving costs giving them back:
no other request's cache is ever copied or moved. (vLLM calls this PagedAttention.)
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from .request import is_int


class BlockManager:
    """Bookkeeping only (pure Python): which blocks are free, who holds which, what is cached.

    Two ways to hand out memory:

    - *Up front* (static and sequential batching): ``reserve`` promises a request room for
      its prompt plus every token it may generate before it starts. A rectangular batch
      cannot shrink or give a row back, so it must never run out midway.
    - *On demand* (continuous and stall-free): ``grow``/``ensure`` take blocks only as a
      request's cache grows; when none is left, the scheduler preempts somebody.

    Every block has a reference count: the number of block tables that hold it. With
    prefix caching a full block is also named by ``block_key`` (a hash of its tokens and of
    its parent block's key), so a later request whose prompt starts with the same tokens
    shares it (count + 1) instead of computing it again. A cached block whose count falls
    to 0 is kept, *evictable*, until an allocation needs it (least recently used first).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_kv_blocks and kv_block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0; oldest first
        self.ref_counts = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.reserved: dict[str, int] = {}  # up front: blocks promised to a request, taken or not
        self.cached: dict[bytes, int] = {}  # prefix cache: block key -> block
        self.key_of: dict[int, bytes] = {}  # and back
        self.keys: dict[str, list[bytes]] = {}  # keys of each request's full blocks so far
        self.hit_blocks = 0  # prefix-cache hits since the start, in blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks_needed(num_tokens, self.block_size)

    @staticmethod
    def blocks_needed(num_tokens: int, block_size: int) -> int:
        return math.ceil(num_tokens / block_size)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never used, or cached and evictable."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    # -- up front -------------------------------------------------------------------------
    @property
    def unreserved(self) -> int:
        """Free blocks nobody has been promised: what admission may hand out."""
        promised = sum(max(n - len(self.tables.get(rid, [])), 0) for rid, n in self.reserved.items())
        return self.num_free - promised

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.unreserved

    def reserve(self, req_id: str, num_tokens: int) -> None:
        """Promise ``req_id`` room for ``num_tokens`` (prompt + every token it may generate)."""
        need = self.blocks_for(num_tokens)
        if need > self.unreserved:
            raise MemoryError(f"{need} KV blocks needed, {self.unreserved} unreserved")
        self.reserved[req_id] = need
        self.tables[req_id] = []

    # -- on demand ------------------------------------------------------------------------
    def blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """New blocks ``req_id`` needs to hold ``num_tokens`` tokens."""
        return max(self.blocks_for(num_tokens) - len(self.tables.get(req_id, [])), 0)

    def ensure(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s block table to hold ``num_tokens`` tokens; return the table.
        MemoryError if the pool (or the request's reservation) is short: schedulers check
        first, so an engine step never meets it."""
        table = self.tables.setdefault(req_id, [])
        if len(table) * self.block_size >= num_tokens:  # the common case: room already
            return table
        need = self.blocks_to_grow(req_id, num_tokens)
        if req_id in self.reserved and len(table) + need > self.reserved[req_id]:
            raise MemoryError(f"{req_id} needs more KV blocks than it reserved")
        if need > self.num_free:
            raise MemoryError(f"{req_id} needs {need} more KV blocks, {self.num_free} are free")
        for _ in range(need):
            table.append(self._take())
        return table

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def check_writable(self, req_id: str, start: int, stop: int) -> None:
        """A pass may write positions ``start..stop-1`` of ``req_id`` only into blocks no
        other table holds: a shared (prefix-cached) block is read-only. Raises if not, so
        a scheduler bug shows up as an error instead of corrupting another request."""
        table = self.tables.get(req_id, [])
        for i in range(start // self.block_size, (stop - 1) // self.block_size + 1):
            if i < len(table) and self.ref_counts[table[i]] > 1:
                raise RuntimeError(
                    f"{req_id}: positions {start}..{stop - 1} would overwrite "
                    f"KV block {table[i]}, which {self.ref_counts[table[i]]} "
                    f"requests share"
                )

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink ``req_id``'s table to the blocks its first ``num_tokens`` tokens use, freeing
        the blocks wholly past them, last first (a speculative row's rejected drafts: their
        keys and values are garbage, and the request's length went back). A block past the
        length holds no full-block name (only computed blocks are cached), so it frees plainly."""
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        table = self.tables.get(req_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._drop(table.pop())

    def _drop(self, block: int) -> None:
        """One table lets go of ``block``: free (or evictable, if cached) when nobody holds it."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def release(self, req_id: str) -> None:
        """Drop ``req_id``'s hold on its blocks. Its last block goes first, so a cached
        prompt's tail is evicted before its head (the head is what others share)."""
        for block in reversed(self.tables.pop(req_id, [])):
            self._drop(block)
        self.reserved.pop(req_id, None)
        self.keys.pop(req_id, None)

    # -- prefix cache ---------------------------------------------------------------------
    @staticmethod
    def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
        """A full block's name: its tokens and everything before them (via the parent's key)."""
        return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The longest run of cached full blocks that ``token_ids`` starts with. The block
        holding the last token is never looked up, so at least one token is computed and
        the request still gets a next-token distribution."""
        if not self.enable_prefix_cache:
            return []
        found, key = [], b""
        for i in range((len(token_ids) - 1) // self.block_size):
            key = self.block_key(key, token_ids[i * self.block_size : (i + 1) * self.block_size])
            if key not in self.cached:
                break
            found.append(self.cached[key])
        return found

    def share(self, req_id: str, blocks: list[int]) -> None:
        """Start ``req_id``'s (empty) table with the cached ``blocks`` found by ``lookup``."""
        table = self.tables.setdefault(req_id, [])
        if table:
            raise ValueError(f"{req_id} already holds blocks; share cached blocks at admission")
        for block in blocks:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
            table.append(block)
        self.keys[req_id] = [self.key_of[b] for b in blocks]
        self.hit_blocks += len(blocks)

    def cache_full_blocks(
        self, req_id: str, num_computed: int, token_ids: Callable[[int, int], Sequence[int]]
    ) -> None:
        """Name every block of ``req_id`` that is now full of computed tokens, so later
        requests can share it. ``token_ids(start, stop)`` reads the request's tokens."""
        if not self.enable_prefix_cache:
            return
        keys, table = self.keys.setdefault(req_id, []), self.tables[req_id]
        for i in range(len(keys), num_computed // self.block_size):
            key = self.block_key(
                keys[-1] if keys else b"", token_ids(i * self.block_size, (i + 1) * self.block_size)
            )
            keys.append(key)
            if key not in self.cached:  # a twin computed elsewhere keeps the name
                self.cached[key], self.key_of[table[i]] = table[i], key
