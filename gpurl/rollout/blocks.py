"""The KV cache's block pool, host side: which blocks of a data shard's pool are free and
how many requests hold each (`BlockPool`), and how many blocks a call needs (`pool_blocks`).

The device pool (`gpurl.kernels.paged_attention`) is `blocks` blocks of `block_size`
tokens per shard; block 0 takes idle rows' writes and is never handed out. A request holds
blocks only for the tokens it has (allocated a decode chunk ahead); requests with the same
prompt share its full blocks (a reference count each), and a block returns to the free
list when its last holder releases it. Plain Python (tested without JAX)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gpurl.buckets import three_bits


class BlockPool:
    """Free blocks and reference counts of one shard's pool of `blocks` blocks."""

    def __init__(self, blocks: int):
        self.free = list(range(blocks - 1, 0, -1))  # popped from the end: lowest first
        self.refs = np.zeros(blocks, np.int32)

    @property
    def size(self) -> int:
        """Blocks that can be handed out (block 0 never is)."""
        return len(self.refs) - 1

    def grow(self, blocks: int) -> None:
        """The pool now has `blocks` blocks; the old ones keep their ids."""
        old = len(self.refs)
        if blocks > old:
            self.free = list(range(blocks - 1, old - 1, -1)) + self.free
            self.refs = np.concatenate([self.refs, np.zeros(blocks - old, np.int32)])

    def take(self, n: int) -> list[int] | None:
        """`n` free blocks, each held once; None (nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        out = [self.free.pop() for _ in range(n)]
        self.refs[out] = 1
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder of `blocks` (a request with the same prompt)."""
        self.refs[list(blocks)] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer; blocks no one holds are free again."""
        for blk in blocks:
            self.refs[blk] -= 1
            if self.refs[blk] == 0:
                self.free.append(blk)


def request_blocks(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


def pool_blocks(need: int, block_size: int, kv_cache_tokens: int = 0) -> int:
    """The pool's blocks for `need` blocks of requests: capped by `kv_cache_tokens` (0 = no
    cap), plus block 0, rounded up to three significant bits (at most 25% over: few pool
    shapes to compile, where a power of two could double a rollout's largest allocation)."""
    if kv_cache_tokens:
        need = min(need, request_blocks(kv_cache_tokens, block_size))
    return three_bits(need + 1)


def blocks_needed(sizes_by_shard: Sequence[Sequence[int]], slots: int) -> int:
    """Blocks a shard's pool needs so that the `slots` largest of each shard's requests
    (blocks each, at their limits) fit at once: the largest such sum over the shards."""
    return max((sum(sorted(sizes, reverse=True)[:slots]) for sizes in sizes_by_shard), default=0)
