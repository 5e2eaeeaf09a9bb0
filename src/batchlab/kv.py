"""KV memory: a pool of fixed-size blocks and a block table per request.

Every layer keeps its keys and values in one big array of token slots,
``[num_blocks * block_size, kv_heads, head_dim]``. A request owns a list of blocks
(its *block table*); its token number ``i`` lives at slot
``table[i // block_size] * block_size + i % block_size``. Joining a batch therefore
costs only taking free blocks from a list, and leaving costs giving them back:
no other request's cache is ever copied or moved. (vLLM calls this PagedAttention.)
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


class BlockManager:
    """Bookkeeping only (pure Python): which blocks are free, which request owns which."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_kv_blocks and kv_block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.tables: dict[str, list[int]] = {}
        self.reserved: dict[str, int] = {}  # blocks promised to a request, taken or not

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks_needed(num_tokens, self.block_size)

    @staticmethod
    def blocks_needed(num_tokens: int, block_size: int) -> int:
        return math.ceil(num_tokens / block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def unreserved(self) -> int:
        """Blocks nobody has been promised: what admission may hand out."""
        return self.num_blocks - sum(self.reserved.values())

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.unreserved

    def reserve(self, req_id: str, num_tokens: int) -> None:
        """Promise ``req_id`` room for ``num_tokens`` (prompt + every token it may generate)."""
        need = self.blocks_for(num_tokens)
        if need > self.unreserved:
            raise MemoryError(f"{need} KV blocks needed, {self.unreserved} unreserved")
        self.reserved[req_id] = need
        self.tables[req_id] = []

    def ensure(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s block table to hold ``num_tokens`` tokens; return the table."""
        table = self.tables[req_id]
        while len(table) * self.block_size < num_tokens:
            if len(table) >= self.reserved[req_id]:
                raise MemoryError(f"{req_id} needs more KV blocks than it reserved")
            table.append(self.free_blocks.pop())
        return table

    def release(self, req_id: str) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(req_id, [])))
        self.reserved.pop(req_id, None)

    def slots(self, req_id: str, start: int, stop: int) -> np.ndarray:
        """Flat slot numbers of tokens ``start..stop-1`` of ``req_id``."""
        table = np.asarray(self.tables[req_id], dtype=np.int32)
        positions = np.arange(start, stop, dtype=np.int32)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


class KVPool:
    """The memory itself (MLX arrays): keys and values of every layer, by flat slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: mx.Dtype):
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.size
