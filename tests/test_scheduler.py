"""The rollout engine's host side without a device (`gpurl.rollout.blocks`,
`gpurl.rollout.scheduler`): plain Python, importable without JAX.

`_drive` runs a scheduler the way `Engine.generate` does, with a NumPy stand-in for the
device programs: the i-th token a request draws is a function of its seed and i only (as
the engine's sampling keys are), so a request preempted and readmitted must come back
with exactly the tokens of one that ran straight through."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gpurl.config import ConfigError
from gpurl.rollout.blocks import BlockPool, blocks_needed, pool_blocks
from gpurl.rollout.requests import Completion, Request
from gpurl.rollout.scheduler import Limits, Needs, Scheduler

VOCAB, STOP = 50, 0


def test_the_scheduler_and_block_pool_import_without_jax():
    code = ("import sys, gpurl.rollout.scheduler, gpurl.rollout.blocks, gpurl.rollout.requests; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_blocks_are_counted_shared_released_and_grown_in_place():
    pool = BlockPool(6)
    assert pool.size == 5 and pool.take(6) is None and len(pool.free) == 5  # nothing taken
    a = pool.take(2)
    assert a == [1, 2]  # lowest first; block 0 is never handed out
    pool.share(a)
    pool.release(a)
    assert pool.refs[1:3].tolist() == [1, 1] and 1 not in pool.free  # still held once
    pool.release(a)
    assert sorted(pool.free) == [1, 2, 3, 4, 5] and not pool.refs.any()
    held = pool.take(5)
    pool.grow(9)
    assert pool.take(3) == [6, 7, 8] and pool.take(1) is None
    assert sorted(held) == [1, 2, 3, 4, 5]


def test_the_pool_rounds_to_three_significant_bits_not_a_power_of_two():
    """A round of 256 rows x 16 blocks needs 4,097 blocks (block 0: idle rows' writes): a
    power of two allocated 8,192 (qwen3_1_7b: 56 GiB for 35), three significant bits 5,120."""
    assert pool_blocks(256 * 16, 16) == 5120
    assert pool_blocks(100, 16) == 112  # not 128
    assert pool_blocks(100, 16, kv_cache_tokens=160) == 12  # capped: 10 + block 0, rounded
    assert blocks_needed([[3, 1, 2], [5]], slots=2) == 5


def _token(seed: int, i: int) -> int:
    """The i-th token request `seed` draws (the stand-in for fold_in(key(seed), i))."""
    return int((seed * 7919 + i * 104729) % VOCAB)


def _drive(sched: Scheduler, pad: int = 0) -> tuple[list[Completion], int]:
    """`Engine.generate`'s loop with the device programs replaced by `_token`; checks the
    pool's reference counts against the requests that hold blocks at every iteration.
    Returns (completions, iterations)."""
    floor, width, blocks = sched.first_needs()
    sched.start(blocks)
    chunk = sched.limits.decode_chunk
    iterations = 0
    while True:
        needs = Needs.agree(np.asarray([sched.plan()]))
        iterations += 1
        if needs.blocks:
            sched.grow(needs.blocks)
        width = max(width, needs.table)
        for shard, admitted in zip(sched.shards, sched.admitted):
            held = np.zeros_like(shard.pool.refs)
            for live in shard.rows + admitted:
                np.add.at(held, live.blocks, 1)
            assert (held == shard.pool.refs).all() and not held[shard.pool.free].any()
        if needs.prefill:
            batch = sched.prefill_batch(needs, len(sched.shards[0].pool.refs), pad)
            s = batch["settings"]
            tok = np.asarray([_token(int(a), int(b)) for a, b in zip(s.seeds, s.offsets)])
            shape = (sched.count, needs.rows)
            sched.accept_prefill(tok.reshape(shape), np.zeros(shape), (tok == STOP).reshape(shape))
        if not needs.decoding:
            if not needs.queued:
                break
            continue
        n = max(needs.decoding, floor)
        batch = sched.chunk_batch(n, width)
        s, (_, _, left) = batch["settings"], batch["state"]
        out = np.zeros((sched.count * n, chunk), np.int32)
        emitted = np.zeros(sched.count * n, np.int32)
        stopped = np.zeros(sched.count * n, bool)
        for row, active in enumerate(batch["active"].reshape(-1)):
            while active and emitted[row] < min(chunk, left.reshape(-1)[row]):
                t = _token(int(s.seeds[row]), int(s.offsets[row]) + int(emitted[row]))
                out[row, emitted[row]] = t
                emitted[row] += 1
                if t == STOP:
                    stopped[row] = True
                    break
        d = sched.count
        sched.accept_chunk(out.reshape(d, n, -1), np.zeros((d, n, chunk)),
                           emitted.reshape(d, n), stopped.reshape(d, n), None)
    for shard in sched.shards:  # every block is back
        assert not shard.pool.refs.any() and len(shard.pool.free) == shard.pool.size
    return sched.completions(), iterations


def _expected(r: Request) -> list[int]:
    out = []
    for i in range(r.max_new_tokens):
        out.append(_token(r.seed, r.offset + i))
        if out[-1] == STOP:
            break
    return out


REQUESTS = ([Request((1, 2, 3, 4, 5, 6), 9, seed=s) for s in range(4)]  # one prompt's group
            + [Request(tuple(range(1, 2 + k)), 3 + 2 * k, seed=10 + k) for k in range(6)])


@pytest.mark.parametrize("shards, slots, cap", [(1, 2, 0), (2, 3, 0), (1, 4, 24)])
def test_every_request_gets_its_own_tokens_however_it_is_scheduled(shards, slots, cap):
    """Two slots, two shards, or a pool capped below what the requests need (they give
    their blocks back and are recomputed): each completion is the one its seed draws."""
    sched = Scheduler(REQUESTS, Limits(slots, 4, 3, cap), shards, lambda r: 0)
    done, iterations = _drive(sched)
    for r, c in zip(REQUESTS, done):
        assert c.tokens.tolist() == _expected(r) and c.stopped == (c.tokens[-1] == STOP)
    assert iterations > len(REQUESTS) // (slots * shards)
    assert (sched.stats["preempted"] > 0) == (cap > 0)


def test_completions_of_one_prompt_share_its_full_blocks():
    sched = Scheduler(REQUESTS[:4], Limits(4, 4, 3), 1, lambda r: 0)
    sched.start(sched.first_needs()[2])
    needs = sched.plan()
    assert needs.prompts == 2 and needs.rows == 4  # one distinct prompt (bucketed to 2)
    first = sched.admitted[0][0].blocks[0]  # the prompt's one full block (6 tokens, blocks of 4)
    assert [x.blocks[0] for x in sched.admitted[0]] == [first] * 4
    assert sched.shards[0].pool.refs[first] == 4
    batch = sched.prefill_batch(needs, len(sched.shards[0].pool.refs), 0)
    written = batch["dest"][0] < len(sched.shards[0].pool.refs) * 4
    assert written[0, :6].all() and written[1:, :4].sum() == 0  # the first row writes it


def test_a_resumed_request_grows_the_pool_and_continues_its_keys():
    """`resume` queues a follow-up (a multi-turn environment's next turn): its longer
    sequence grows the pool at the next plan, and its draws continue at its offset."""
    turns, last = {}, dict(enumerate(REQUESTS[4:6]))

    def resume(i: int, c: Completion) -> Request | None:
        turns[i] = turns.get(i, 0) + 1
        if turns[i] > 2:
            return None
        r = last[i]
        last[i] = Request(r.prompt + tuple(c.tokens) + (7,) * 20, 3, seed=r.seed,
                          offset=r.offset + len(c.tokens))
        return last[i]

    sched = Scheduler(REQUESTS[4:6], Limits(2, 4, 3), 1, lambda r: 0, resume)
    grown = []
    plan = sched.plan
    sched.plan = lambda: grown.append(plan()) or grown[-1]
    done, _ = _drive(sched)
    assert any(n.blocks for n in grown[1:])
    assert turns == {0: 3, 1: 3}
    for i, c in enumerate(done):
        assert last[i].offset > 0 and c.tokens.tolist() == _expected(last[i])


def test_needs_agree_on_the_largest_shapes_and_the_total_queue():
    a = Needs(0, 4, 1, 2, 4, 16, 8, 3)
    b = Needs(12, 8, 0, 0, 0, 0, 0, 5)
    assert Needs.agree(np.asarray([a, b])) == Needs(12, 8, 1, 2, 4, 16, 8, 8)


def test_a_pool_too_small_for_one_request_is_one_sentence():
    sched = Scheduler([Request(tuple(range(1, 30)), 4)], Limits(2, 4, 3, kv_cache_tokens=16), 1,
                      lambda r: 0)
    with pytest.raises(ConfigError, match=r"^the KV cache \(4 blocks of 4 tokens per shard\) "
                                          r"cannot hold one request of 29 tokens plus a decode "
                                          r"chunk; raise rollout.kv_cache_tokens .*\.$"):
        _drive(sched)
    with pytest.raises(ConfigError, match=r"^a prompt is empty"):
        Scheduler([Request((), 4)], Limits(2, 4, 3), 1, lambda r: 0)
