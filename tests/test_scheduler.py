"""The rollout engine's host side without a device (`gpurl.rollout.blocks`,
`gpurl.rollout.scheduler`): plain Python, importable without JAX.

`_drive` runs a scheduler the way `Engine.generate` does, with a NumPy stand-in for the
device programs: the i-th token a request draws is a function of its seed and i only (as
the engine's sampling keys are), so a request preempted and readmitted must come back
with exactly the tokens of one that ran straight through."""

from __future__ import annotations

import subprocess
from typing import Callable, Sequence
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


def _drive(sched: Scheduler, pad: int = 0, versions: dict[int, int] | None = None
           ) -> tuple[list[Completion], int]:
    """`Engine.generate`'s loop with the device programs replaced by `_token`; checks the
    pool's reference counts against the requests that hold blocks at every iteration, and
    keeps a stand-in of the device pool (the token and the policy version of every slot) to
    check that every row reads its own sequence there: a prefill's cached blocks hold the
    sequence's tokens as the version sampling now computed them, and a decode chunk's rows
    find their tokens in their blocks. `versions`: iteration -> the version set before it.
    Returns (completions, iterations)."""
    floor, width, blocks = sched.first_needs()
    sched.start(blocks)
    chunk, size = sched.limits.decode_chunk, sched.limits.block_size
    tokens = [np.full(blocks * size, -1) for _ in range(sched.count)]  # the pool stand-in
    written = [np.full(blocks * size, -1) for _ in range(sched.count)]
    iterations = 0
    while True:
        if versions and iterations in versions:
            sched.version = versions[iterations]
        needs = Needs.agree(np.asarray([sched.plan()]))
        iterations += 1
        if needs.blocks:
            sched.grow(needs.blocks)
        pool_slots = len(sched.shards[0].pool.refs) * size
        for s in range(sched.count):
            extra = pool_slots - len(tokens[s])
            tokens[s] = np.concatenate([tokens[s], np.full(extra, -1)])
            written[s] = np.concatenate([written[s], np.full(extra, -1)])
        width = max(width, needs.table)
        for shard, admitted in zip(sched.shards, sched.admitted):
            pool = shard.pool
            held = np.zeros_like(pool.refs)
            for live in shard.rows + admitted:
                np.add.at(held, live.blocks, 1)
            assert (held == pool.refs).all() and not held[pool.free].any()
            assert not held[list(pool.idle)].any() and set(pool.idle) <= set(pool.keys)
            assert not set(pool.idle) & set(pool.free)
            assert sorted(pool.digests.values()) == sorted(pool.keys)
        if needs.prefill:
            batch = sched.prefill_batch(needs, len(sched.shards[0].pool.refs), pad)
            for s, rows in enumerate(sched.admitted):
                for i, live in enumerate(rows):
                    j, seq, start = batch["src"][s, i], live.sequence, live.start
                    assert batch["starts"][s, j] == start and batch["lengths"][s, j] == len(seq)
                    assert batch["tokens"][s, j, :len(seq) - start].tolist() == seq[start:]
                    cached = batch["cached"][s, j, :start // size]
                    slots = (cached[:, None] * size + np.arange(size)).reshape(-1)
                    assert tokens[s][slots].tolist() == seq[:start]
                    assert (written[s][slots] == sched.version).all()
                for i, live in enumerate(rows):
                    dest = batch["dest"][s, i]
                    put = dest < pool_slots
                    tokens[s][dest[put]] = np.asarray(live.sequence)[live.start:][put[:live.length - live.start]]
                    written[s][dest[put]] = sched.version
            st = batch["settings"]
            tok = np.asarray([_token(int(a), int(b)) for a, b in zip(st.seeds, st.offsets)])
            shape = (sched.count, needs.rows)
            sched.accept_prefill(tok.reshape(shape), np.zeros(shape), (tok == STOP).reshape(shape))
        if not needs.decoding:
            if not needs.queued:
                break
            continue
        n = max(needs.decoding, floor)
        batch = sched.chunk_batch(n, width)
        st, (_, _, left) = batch["settings"], batch["state"]
        for s, shard in enumerate(sched.shards):
            for i, live in enumerate(shard.rows):
                pos = np.arange(live.length)
                slots = batch["table"][s, i][pos // size] * size + pos % size
                assert tokens[s][slots].tolist() == live.sequence[:live.length]
        out = np.zeros((sched.count * n, chunk), np.int32)
        emitted = np.zeros(sched.count * n, np.int32)
        stopped = np.zeros(sched.count * n, bool)
        for row, active in enumerate(batch["active"].reshape(-1)):
            while active and emitted[row] < min(chunk, left.reshape(-1)[row]):
                t = _token(int(st.seeds[row]), int(st.offsets[row]) + int(emitted[row]))
                out[row, emitted[row]] = t
                emitted[row] += 1
                if t == STOP:
                    stopped[row] = True
                    break
        d = sched.count
        for s, shard in enumerate(sched.shards):  # the fed tokens' keys and values
            for i, live in enumerate(shard.rows):
                fed = [live.tokens[-1], *out[s * n + i, :emitted[s * n + i] - 1]]
                pos = live.length + np.arange(len(fed))
                slots = batch["table"][s, i][pos // size] * size + pos % size
                tokens[s][slots], written[s][slots] = fed, sched.version
        sched.accept_chunk(out.reshape(d, n, -1), np.zeros((d, n, chunk)),
                           emitted.reshape(d, n), stopped.reshape(d, n), None)
    for shard in sched.shards:  # every block is back
        assert not shard.pool.refs.any() and shard.pool.available == shard.pool.size
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
    a = Needs(0, 4, 1, 2, 4, 16, 0, 8, 3)
    b = Needs(12, 8, 0, 0, 0, 0, 2, 0, 5)
    assert Needs.agree(np.asarray([a, b])) == Needs(12, 8, 1, 2, 4, 16, 2, 8, 8)


def test_a_pool_too_small_for_one_request_is_one_sentence():
    sched = Scheduler([Request(tuple(range(1, 30)), 4)], Limits(2, 4, 3, kv_cache_tokens=16), 1,
                      lambda r: 0)
    with pytest.raises(ConfigError, match=r"^the KV cache \(4 blocks of 4 tokens per shard\) "
                                          r"cannot hold one request of 29 tokens plus a decode "
                                          r"chunk; raise rollout.kv_cache_tokens .*\.$"):
        _drive(sched)
    with pytest.raises(ConfigError, match=r"^a prompt is empty"):
        Scheduler([Request((), 4)], Limits(2, 4, 3), 1, lambda r: 0)


def _turns(first: Sequence[Request], turns: int, observation: int
           ) -> tuple[Callable[[int, Completion], Request | None], dict[int, list[Request]]]:
    """A multi-turn `resume`: each request goes on for `turns` turns, each next turn's
    prompt its sequence so far plus `observation` tokens (an environment's reply); and the
    requests of every turn, by index."""
    asked = {i: [r] for i, r in enumerate(first)}

    def resume(i: int, c: Completion) -> Request | None:
        if len(asked[i]) == turns:
            return None
        r = asked[i][-1]
        obs = tuple(range(20 + len(asked[i]), 20 + len(asked[i]) + observation))
        asked[i].append(Request(r.prompt + tuple(c.tokens) + obs, r.max_new_tokens, seed=r.seed,
                                offset=r.offset + len(c.tokens)))
        return asked[i][-1]
    return resume, asked


GROUP = [Request(tuple(range(1, 11)), 5, seed=100 + s) for s in range(4)]  # a group of 4


@pytest.mark.parametrize("cache", [True, False])
def test_a_trajectorys_next_turn_prefills_only_its_new_tokens(cache):
    """Four trajectories of 6 turns: with the prefix cache a turn computes only the tokens
    after the last full block the previous turn left in the pool (the observation, the
    completion's last token and less than a block more), and the group's prompt once;
    without it, every turn its whole sequence. The tokens are the same."""
    resume, asked = _turns(GROUP, turns=6, observation=7)
    sched = Scheduler(GROUP, Limits(4, 4, 3, prefix_cache=cache), 1, lambda r: 0, resume)
    done, _ = _drive(sched)
    for i, c in enumerate(done):
        assert len(asked[i]) == 6 and c.tokens.tolist() == _expected(asked[i][-1])
    sequences = sum(len(r.prompt) for rs in asked.values() for r in rs)
    stats = sched.stats
    assert stats["sequence_tokens"] == sequences
    if cache:
        # the prompt once, then per turn the observation, the completion's last token (never
        # fed while decoding) and what it shares a block with (under a block, 4 tokens)
        assert stats["prefill_tokens"] <= 10 + 4 * 5 * ((7 + 1) + 3)
        # the rest was found in the cache, but for the group's three other first prompts
        # (computed once, by the first, in the same prefill)
        assert stats["cached_tokens"] == sequences - stats["prefill_tokens"] - 3 * 10
    else:
        assert stats["prefill_tokens"] == 10 + sequences - 4 * 10  # the prompt once per group
        assert stats["cached_tokens"] == 0


def test_a_block_written_by_one_version_is_never_read_by_the_next():
    """New weights between turns: the next turn's lookup misses the blocks the old version
    computed (`_drive` checks that every cached slot a prefill reads was written by the
    version sampling now), and hits again once the new version has written its own."""
    resume, asked = _turns(GROUP[:2], turns=4, observation=5)
    same = Scheduler(GROUP[:2], Limits(2, 4, 3), 1, lambda r: 0, resume)
    _drive(same)
    assert same.stats["cached_tokens"] > 0
    resume, asked = _turns(GROUP[:2], turns=4, observation=5)
    moved = Scheduler(GROUP[:2], Limits(2, 4, 3), 1, lambda r: 0, resume)
    done, _ = _drive(moved, versions={3: 1, 7: 2})
    for i, c in enumerate(done):
        assert c.tokens.tolist() == _expected(asked[i][-1])
    assert 0 < moved.stats["cached_tokens"] < same.stats["cached_tokens"]


def test_eviction_under_a_small_pool_keeps_every_running_requests_blocks():
    """Distinct prompts through a pool capped at 12 blocks: remembered blocks are handed
    out again (evicted, least recently used first) and rows are preempted, but no running
    row's block is ever overwritten (`_drive` reads every row's tokens back each chunk)."""
    requests = [Request(tuple(range(k, k + 9)), 7, seed=k) for k in range(1, 13)]
    resume, asked = _turns(requests, turns=2, observation=3)
    sched = Scheduler(requests, Limits(3, 4, 3, kv_cache_tokens=44), 1, lambda r: 0, resume)
    done, _ = _drive(sched)
    for i, c in enumerate(done):
        assert c.tokens.tolist() == _expected(asked[i][-1])
    assert sched.stats["evicted"] > 0 and sched.stats["cached_tokens"] > 0


def test_the_blocks_a_flush_lets_go_are_forgotten():
    """A checkpoint's flush forgets the cache: the rows readmitted compute their sequences
    again, as a run resumed from that checkpoint (with an empty cache) does."""
    sched = Scheduler(GROUP, Limits(4, 4, 3), 1, lambda r: 0)
    sched.start(sched.first_needs()[2])
    sched.plan()
    sched.accept_prefill(*(np.full((1, 4), x) for x in (7, 0.0, False)))
    assert len(sched.shards[0].pool.keys) == 2  # the prompt's two full blocks
    sched.flush()
    pool = sched.shards[0].pool
    assert not pool.keys and not pool.idle and pool.available == pool.size
    sched.plan()
    assert [x.start for x in sched.admitted[0]] == [0] * 4
