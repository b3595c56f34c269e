"""The KV cache's block pool, host side: which blocks of a data shard's pool are free and
how many requests hold each (`BlockPool`), and how many blocks a call needs (`pool_blocks`).

The device pool (`gpurl.kernels.paged_attention`) is `blocks` blocks of `block_size`
tokens per shard; block 0 takes idle rows' writes and is never handed out. A request holds
blocks only for the tokens it has (allocated a decode chunk ahead); requests with the same
prompt share its full blocks (a reference count each), and a block returns to the free
list when its last holder releases it.

With the prefix cache on, a full block also keeps what it holds after its last holder
lets it go: it is remembered under a digest of every token from the start of the
sequence to its end and of the policy version whose weights computed its keys and values
(`remember`), and a later request whose sequence starts with the same tokens, sampling
with the same version, holds it again instead of computing it (`lookup`; the tokens and
the digest of the block before are compared on a hit, so a match is exact). Remembered
blocks no one holds are handed out last, least recently used first (evicted), so the
cache only ever fills blocks that would otherwise be free. Plain Python (tested without
JAX)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from gpurl.buckets import three_bits


class BlockPool:
    """Free blocks, reference counts and (`cache`) remembered full blocks of one shard's
    pool of `blocks` blocks of `block_size` tokens."""

    def __init__(self, blocks: int, block_size: int = 1, cache: bool = False):
        self.free = list(range(blocks - 1, 0, -1))  # popped from the end: lowest first
        self.refs = np.zeros(blocks, np.int32)
        self.block_size, self.cache = block_size, cache
        self.digests: dict[bytes, int] = {}  # digest -> the block remembered under it
        self.keys: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}  # block -> (digest, parent's, tokens)
        self.idle: OrderedDict[int, None] = OrderedDict()  # remembered, held by no one: oldest first
        self.evicted = 0  # remembered blocks handed out for other tokens

    @property
    def size(self) -> int:
        """Blocks that can be handed out (block 0 never is)."""
        return len(self.refs) - 1

    @property
    def available(self) -> int:
        """Blocks `take` can hand out: free ones and remembered ones no one holds."""
        return len(self.free) + len(self.idle)

    def grow(self, blocks: int) -> None:
        """The pool now has `blocks` blocks; the old ones keep their ids."""
        old = len(self.refs)
        if blocks > old:
            self.free = list(range(blocks - 1, old - 1, -1)) + self.free
            self.refs = np.concatenate([self.refs, np.zeros(blocks - old, np.int32)])

    def take(self, n: int) -> list[int] | None:
        """`n` blocks, each held once: free ones first, then remembered ones no one holds,
        least recently used first (forgotten); None (nothing taken) when fewer are there."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop())
            else:
                blk, _ = self.idle.popitem(last=False)
                del self.digests[self.keys.pop(blk)[0]]
                self.evicted += 1
                out.append(blk)
        self.refs[out] = 1
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder of `blocks` (a request with the same prefix)."""
        for blk in blocks:
            if self.refs[blk] == 0:
                del self.idle[blk]
            self.refs[blk] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer; blocks no one holds are free again (remembered ones: idle,
        the most recently used)."""
        for blk in blocks:
            self.refs[blk] -= 1
            if self.refs[blk] == 0:
                if blk in self.keys:
                    self.idle[blk] = None
                else:
                    self.free.append(blk)

    def lookup(self, tokens: Sequence[int], salt: int | str, most: int) -> list[int]:
        """The remembered blocks holding the longest run of `tokens`' first full blocks
        (at most `most`) computed by policy version `salt`; none with the cache off.
        Nothing is held: `share` them."""
        out: list[int] = []
        if not self.cache:
            return out
        for digest, parent, block in _chain(tokens, self.block_size, salt, most):
            blk = self.digests.get(digest)
            if blk is None or self.keys[blk][1:] != (parent, block):
                break
            out.append(blk)
        return out

    def remember(self, blocks: Sequence[int], tokens: Sequence[int], salt: int | str,
                 full: int) -> None:
        """Remembers the first `full` of `blocks`, which hold `tokens`' first full blocks as
        policy version `salt` computed them. A block remembered already keeps its key (its
        digest is the next block's parent: only the blocks new to the cache are hashed),
        and a digest another block holds is not taken twice."""
        if not self.cache:
            return
        size, parent = self.block_size, _root(salt)
        for i, blk in enumerate(blocks[:min(full, len(tokens) // size)]):
            if blk in self.keys:
                parent = self.keys[blk][0]
                continue
            block = tuple(int(t) for t in tokens[i * size:(i + 1) * size])
            digest = _digest(parent, block)
            if digest not in self.digests:
                self.digests[digest] = blk
                self.keys[blk] = (digest, parent, block)
            parent = digest

    def forget(self) -> None:
        """Forgets every remembered block (those no one holds are free again)."""
        self.free += sorted(self.idle, reverse=True)
        self.idle.clear()
        self.digests.clear()
        self.keys.clear()


def _root(salt: int | str) -> bytes:
    """The digest a sequence's first block hashes as its parent: the policy version's."""
    return hashlib.blake2b(f"version {salt}".encode(), digest_size=16).digest()


def _digest(parent: bytes, block: tuple[int, ...]) -> bytes:
    """A block's digest: of the block before's and its tokens (blake2b, 128 bits)."""
    return hashlib.blake2b(parent + np.asarray(block, np.int64).tobytes(), digest_size=16).digest()


def _chain(tokens: Sequence[int], block_size: int, salt: int | str, full: int):
    """(digest, the block before's digest, the block's tokens) of `tokens`' first `full`
    full blocks, the first one's parent the policy version `salt`'s root."""
    parent = _root(salt)
    for i in range(min(full, len(tokens) // block_size)):
        block = tuple(int(t) for t in tokens[i * block_size:(i + 1) * block_size])
        digest = _digest(parent, block)
        yield digest, parent, block
        parent = digest


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
