"""The rollout engine (`gpurl.rollout.engine`: continuous batching over decode slots, a
paged KV cache) against the static sampler, which tests/test_sampler.py checks against
transformers; the training forward pass's log-probs; and its own promises: a request's
tokens and log-probs do not depend on what shares its batch or where it lands, a prompt's
completions share its cache blocks, the cache follows the tokens in flight, a full cache
preempts and resumes, paused requests resume with appended tokens, and compiles stay
bounded.

Engines here use blocks of 4 tokens and chunks of 3 decode steps, so every request spans
several blocks and several chunks, and 2 slots per shard, so requests queue."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from gpurl.config import ConfigError
from gpurl.rollout.engine import Engine
from gpurl.rollout.requests import Completion, Request
from gpurl.rollout.programs import Rollout
from test_sampler import (LOGPROB_TOL, MESH, N, ONE_DEVICE, PAD, PROMPTS, RULES, SAMPLING,
                          SEEDS, Tiny, _build_tiny, _max_diff, _rows, behaviour_logprobs)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """family -> its Tiny, built once per module (test_sampler.py's models)."""
    return functools.lru_cache(maxsize=None)(
        lambda family: _build_tiny(family, tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="module")
def gemma2(tiny_models: Any) -> Tiny:
    return tiny_models("gemma2")


SMALL = dict(block_size=4, decode_chunk=3, slots=2)
_ENGINES: dict[tuple, Engine] = {}


def engine(tiny: Tiny, setting: str = "greedy", mesh: Any = MESH,
           stop_ids: tuple[int, ...] | None = None, **overrides: Any) -> Engine:
    """One shared Engine per (model, setting, mesh, stops, overrides)."""
    stops = tiny.stop_ids if stop_ids is None else stop_ids
    key = (tiny.family, setting, id(mesh), stops, tuple(sorted(overrides.items())))
    if key not in _ENGINES:
        cfg = dataclasses.replace(SAMPLING[setting], **{**SMALL, **overrides})
        _ENGINES[key] = Engine(tiny.spec, cfg, mesh, RULES, stop_ids=stops, pad_id=PAD)
    return _ENGINES[key]


def _generate(e: Engine, tiny: Tiny, prompts: list[list[int]], seeds: list[int],
              **kw: Any) -> list[Completion]:
    return e.generate(tiny.params, [e.request(p, s) for p, s in zip(prompts, seeds)], **kw)


def _same(a: Completion, b: Completion) -> bool:
    """Equal tokens, log-probs equal to float32 rounding: XLA's CPU matmul blocks rows by
    the row count (a 640-wide projection gives bit-equal rows for 2..32 rows, not from 64
    on), so a prefill of other prompts alongside can move the last bit of a log-prob."""
    return (np.array_equal(a.tokens, b.tokens)
            and bool(np.abs(a.logprobs - b.logprobs).max(initial=0.0) <= 2e-6))


@pytest.mark.parametrize("setting", ["greedy", pytest.param("nucleus", marks=pytest.mark.slow),
                                     pytest.param("top_k", marks=pytest.mark.slow)])
def test_engine_equals_the_static_sampler(gemma2: Tiny, setting: str) -> None:
    """Gemma 2 (soft-capped attention, a sliding window of 4 that every row outruns):
    the same tokens as the static sampler for the same seeds, greedy and sampled, with
    top-k and nucleus truncation; log-probs within float32 noise."""
    ref = _rows(gemma2.sampler(setting).generate(gemma2.params, PROMPTS, SEEDS), 4)
    done = _generate(engine(gemma2, setting), gemma2, PROMPTS, SEEDS)
    for i, c in enumerate(done):
        n = ref[1][i]
        assert c.tokens.tolist() == ref[0][i, :n].tolist(), i
        np.testing.assert_allclose(c.logprobs, ref[2][i, :n], atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_moe"])
def test_engine_greedy_equals_the_static_sampler_per_family(tiny_models: Any, family: str) -> None:
    tiny = tiny_models(family)
    ref = _rows(tiny.sampler("greedy").generate(tiny.params, PROMPTS, SEEDS), 4)
    done = _generate(engine(tiny), tiny, PROMPTS, SEEDS)
    assert [c.tokens.tolist() for c in done] == [ref[0][i, :ref[1][i]].tolist() for i in range(4)]


@pytest.mark.parametrize("setting", [pytest.param("greedy", marks=pytest.mark.slow), "nucleus"])
def test_engine_logprobs_match_training_forward(gemma2: Tiny, setting: str) -> None:
    done = _generate(engine(gemma2, setting), gemma2, PROMPTS, SEEDS)
    # the whole tempered softmax, whatever nucleus the token was drawn from
    ours, ref = behaviour_logprobs(gemma2, _rollout(done), SAMPLING[setting])
    assert _max_diff(ours, ref) < LOGPROB_TOL


@pytest.mark.parametrize("setting", ["top_k_50", "top_p_0.9"])
def test_truncated_sampling_leaves_every_behaviour_correction_at_one(gemma2: Tiny,
                                                                     setting: str) -> None:
    """The same weights sample with top-k 50 or top-p 0.9 (of 300 tokens) and train: log r =
    log pi_old - log pi_sampler is 0 to float32 rounding on every token, so truncated
    weights (C = 2) read at the token, sequence and geometric level are all 1, IcePop's band
    [0.5, 5] read at each level masks nothing, and no token is over the mismatch
    threshold. Before, the sampler recorded the truncated distribution's log-probs, and r
    was the kept mass S on every token (`behaviour_logprobs` checks that S binds here)."""
    from gpurl.algorithms.behaviour import behaviour_weights, mismatch_metrics
    from gpurl.config import TISLevel

    done = _generate(engine(gemma2, setting), gemma2, PROMPTS, SEEDS)
    rollout = _rollout(done)
    sampler, trainer = behaviour_logprobs(gemma2, rollout, SAMPLING[setting])
    n = max(map(len, sampler))
    pad = lambda rows: jnp.asarray([np.pad(r, (0, n - len(r))) for r in rows], jnp.float32)  # noqa: E731
    sampler_BxN, old_BxN = pad(sampler), pad(trainer)
    mask_BxN = pad([np.ones(len(r)) for r in sampler])
    log_r = np.asarray((old_BxN - sampler_BxN) * mask_BxN)
    assert np.abs(log_r).max() < LOGPROB_TOL, np.abs(log_r).max()
    for level in TISLevel:
        weights, metrics = behaviour_weights(old_BxN, sampler_BxN, mask_BxN, 2.0, level,
                                             (0.5, 5.0), level)
        # a sequence's weight multiplies its N ratios: within N x the per-token rounding
        np.testing.assert_allclose(weights, mask_BxN, atol=N * LOGPROB_TOL, err_msg=level)
        assert float(metrics["off_policy/masked_fraction"]) == 0.0, level
        assert float(metrics["off_policy/weight_clip_fraction"]) == 0.0, level
    measured = mismatch_metrics(old_BxN, sampler_BxN, mask_BxN, mask_BxN.sum(), 0.1)
    assert float(measured["mismatch/over_threshold"]) == 0.0


def _rollout(done: list[Completion]) -> Rollout:
    """The engine's completions as the static sampler's padded rows."""
    n = max(len(c.tokens) for c in done)
    tokens = np.full((len(done), n), PAD, np.int32)
    logprobs = np.zeros((len(done), n), np.float32)
    for i, c in enumerate(done):
        tokens[i, :len(c.tokens)], logprobs[i, :len(c.tokens)] = c.tokens, c.logprobs
    return Rollout(tokens, np.asarray([len(c.tokens) for c in done]), logprobs)


@pytest.mark.parametrize("setting", ["greedy", pytest.param("nucleus", marks=pytest.mark.slow)])
def test_a_chunked_prefill_equals_a_whole_one(gemma2: Tiny, setting: str) -> None:
    """rollout.prefill_chunk=16: prompts of up to 45 tokens (width 64) prefill in 4
    chunks, each attending to the keys before it, across Gemma 2's sliding window of 4
    and its soft cap, with prompts shorter than a chunk beside them; their tokens and
    log-probs equal a whole prefill's (float32 rounding)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, hf_models.VOCAB, n).tolist() for n in (45, 17, 5, 32)]
    seeds = [11, 12, 13, 14]
    whole = _generate(engine(gemma2, setting), gemma2, prompts, seeds)
    chunked = engine(gemma2, setting, prefill_chunk=16)
    parts = _generate(chunked, gemma2, prompts, seeds)
    for i, (a, b) in enumerate(zip(whole, parts)):
        assert _same(a, b), (i, a.tokens, b.tokens, np.abs(a.logprobs - b.logprobs).max())


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["greedy", "nucleus"])
def test_a_request_does_not_depend_on_its_batch_or_slot(gemma2: Tiny, setting: str) -> None:
    """Alone, among other requests (in another order, so it lands in another slot and
    shard), in a batch of more slots: identical tokens, log-probs to float32 rounding."""
    e = engine(gemma2, setting)
    rng = np.random.default_rng(1)
    others = [rng.integers(3, hf_models.VOCAB, n).tolist() for n in (3, 20, 11, 2, 7, 14)]
    alone = [_generate(e, gemma2, [p], [s])[0] for p, s in zip(PROMPTS, SEEDS)]
    mixed_prompts = others[:3] + PROMPTS[::-1] + others[3:]
    mixed_seeds = [90, 91, 92] + SEEDS[::-1] + [93, 94, 95]
    mixed = _generate(e, gemma2, mixed_prompts, mixed_seeds)
    wide = _generate(engine(gemma2, setting, slots=8, decode_chunk=5), gemma2,
                     mixed_prompts, mixed_seeds)
    for i in range(4):
        assert _same(alone[i], mixed[6 - i]), i
        assert _same(alone[i], wide[6 - i]), i


@pytest.mark.slow
def test_completions_of_one_prompt_share_its_blocks(gemma2: Tiny) -> None:
    """G completions of a 9-token prompt (two full blocks of 4) list the same prompt
    blocks and sample as if each had its own copy."""
    e = engine(gemma2, "nucleus")
    prompt, seeds = PROMPTS[1], list(range(40, 46))
    shared = _generate(e, gemma2, [prompt] * 6, seeds)
    assert e.stats["prefills"] >= 1
    own = [_generate(e, gemma2, [prompt], [s])[0] for s in seeds]
    assert all(_same(a, b) for a, b in zip(shared, own))
    assert len({tuple(c.tokens) for c in shared}) > 1  # different samples


@pytest.mark.slow
def test_cache_follows_tokens_in_flight_and_preempts_when_full(gemma2: Tiny) -> None:
    """A cap below the requests' worst case: the newest request gives its blocks back and
    resumes later by recomputing its tokens; every request still ends as without the cap."""
    prompts = PROMPTS * 2
    seeds = list(range(8))
    free = _generate(engine(gemma2, "greedy", slots=4), gemma2, prompts, seeds)
    capped = engine(gemma2, "greedy", slots=4, kv_cache_tokens=56)
    done = _generate(capped, gemma2, prompts, seeds)
    assert capped.stats["preempted"] > 0
    assert [c.tokens.tolist() for c in done] == [c.tokens.tolist() for c in free]
    for a, b in zip(done, free):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # Sized for the requests: 4 of 24 tokens in flight per shard = 24 blocks, not slots x
    # the longest row.
    pool = free and engine(gemma2, "greedy", slots=4)._pool[0]
    assert pool.shape[2] <= 32


def test_per_request_limits_and_stops(gemma2: Tiny) -> None:
    e = engine(gemma2, "greedy")
    base = _generate(e, gemma2, PROMPTS, SEEDS)
    stop = int(base[1].tokens[2])
    reqs = [Request(tuple(PROMPTS[0]), 3, 0.0), Request(tuple(PROMPTS[1]), N, 0.0, stop_ids=(stop,)),
            Request(tuple(PROMPTS[2]), 1, 0.0), Request(tuple(PROMPTS[3]), N, 0.0)]
    done = e.generate(gemma2.params, reqs)
    assert done[0].tokens.tolist() == base[0].tokens[:3].tolist() and not done[0].stopped
    assert done[1].tokens.tolist() == base[1].tokens[:3].tolist() and done[1].stopped
    assert done[2].tokens.tolist() == base[2].tokens[:1].tolist()
    assert _same(done[3], base[3])
    with pytest.raises(ConfigError, match="a prompt is empty"):
        e.generate(gemma2.params, [Request((), 2)])


@pytest.mark.slow  # the multi-turn layout test (test_envs) resumes requests too
def test_a_paused_request_resumes_with_appended_tokens(gemma2: Tiny) -> None:
    """A multi-turn row: after 4 tokens it gives up its slot, an environment appends 12
    tokens (the sequence outgrows the call's block tables and KV pool, which grow), and it
    resumes; its second turn equals a request of the whole sequence whose keys continue
    after the 4 drawn tokens (offset)."""
    e = engine(gemma2, "nucleus")
    reply = list(range(7, 19))
    turns: dict[int, list[Completion]] = {}

    def resume(i: int, c: Completion) -> Request | None:
        turns.setdefault(i, []).append(c)
        if len(turns[i]) == 2:
            return None
        r = first[i]
        return dataclasses.replace(r, prompt=r.prompt + tuple(c.tokens) + tuple(reply),
                                   max_new_tokens=N, offset=len(c.tokens))

    first = [dataclasses.replace(e.request(p, s), max_new_tokens=4) for p, s in zip(PROMPTS, SEEDS)]
    with warnings.catch_warnings():  # the pool grows without a donation JAX cannot use
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        last = e.generate(gemma2.params, first, resume=resume)
    for i, r in enumerate(first):
        whole = dataclasses.replace(r, prompt=r.prompt + tuple(turns[i][0].tokens) + tuple(reply),
                                    max_new_tokens=N, offset=len(turns[i][0].tokens))
        again = e.generate(gemma2.params, [whole])[0]
        assert _same(last[i], again) and _same(turns[i][1], again)


@pytest.mark.slow
def test_sharded_equals_one_device(gemma2: Tiny) -> None:
    a = _generate(engine(gemma2, "nucleus"), gemma2, PROMPTS, SEEDS)
    single = engine(gemma2, "nucleus", mesh=ONE_DEVICE)
    b = single.generate(single.place(gemma2.params), [single.request(p, s)
                                                      for p, s in zip(PROMPTS, SEEDS)])
    for x, y in zip(a, b):
        assert x.tokens.tolist() == y.tokens.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


@pytest.mark.slow
def test_compiles_stay_bounded(gemma2: Tiny) -> None:
    """6 calls of 1..12 requests with prompts of 1..40 tokens and limits of 1..8: the
    shapes are powers of two, so the programs compiled stay few."""
    e = engine(gemma2, "nucleus", slots=4)
    rng = np.random.default_rng(3)
    for _ in range(6):
        count = int(rng.integers(1, 13))
        reqs = [Request(tuple(rng.integers(3, hf_models.VOCAB, int(rng.integers(1, 41))).tolist()),
                        int(rng.integers(1, N + 1)), 1.0, seed=int(rng.integers(1000)))
                for _ in range(count)]
        done = e.generate(gemma2.params, reqs)
        assert all(1 <= len(c.tokens) <= r.max_new_tokens for c, r in zip(done, reqs))
    print(f"\n6 calls compiled {e.num_compiles()} programs")
    assert e.num_compiles() <= 16


def _drain(stream: Any, params: Any, version: int, got: dict) -> None:
    while stream.iterate(params, version):
        got.update(stream.finished())
    got.update(stream.finished())


def test_a_stream_generates_what_generate_does_as_requests_join(gemma2: Tiny) -> None:
    """Continuous generation (`Engine.stream`): a prompt group joins two iterations in,
    while the first decodes, and the version label moves every two iterations: every
    completion equals `generate`'s, and its tokens carry the versions in order, several
    completions spanning two."""
    e = engine(gemma2, "nucleus")
    reqs = [e.request(p, s) for p, s in zip(PROMPTS, SEEDS)]
    want = e.generate(gemma2.params, reqs)
    stream, got, it = e.stream(), {}, 0
    assert stream.add(reqs[:2]) == [0, 1]
    while True:
        if it == 2:
            assert stream.add(reqs[2:]) == [2, 3]
        busy = stream.iterate(gemma2.params, it // 2)
        got.update(stream.finished())
        it += 1
        if not busy and it > 2:
            break
    assert sorted(got) == [0, 1, 2, 3]
    for i, c in got.items():
        assert _same(c, want[i]), i
        assert len(c.versions) == len(c.tokens) and (np.diff(c.versions) >= 0).all()
    assert sum(len(set(c.versions.tolist())) > 1 for c in got.values()) >= 2


@pytest.mark.slow  # the continuous-mode tests (test_continuous) swap and drop too
def test_new_weights_enter_between_chunks_and_stale_requests_start_over(gemma2: Tiny) -> None:
    """Weights swapped in flight: a completion's tokens before the swap are the old
    policy's (its versions 0, then 1); `drop_stale(1)` restarts every request holding a
    version-0 token, and what they then generate under the new weights equals a fresh
    `generate` with them."""
    e = engine(gemma2, "nucleus")
    reqs = [e.request(p, s) for p, s in zip(PROMPTS, SEEDS)]
    new = jax.tree.map(lambda x: x * 1.1, gemma2.params)
    old_done, new_done = e.generate(gemma2.params, reqs), e.generate(new, reqs)
    swapped, got = e.stream(), {}
    swapped.add(reqs)
    for _ in range(2):
        swapped.iterate(gemma2.params, 0)
    _drain(swapped, new, 1, got)
    spans = 0
    for i, c in got.items():
        k = int((c.versions == 0).sum())
        assert c.versions.tolist() == [0] * k + [1] * (len(c.tokens) - k)
        assert c.tokens[:k].tolist() == old_done[i].tokens[:k].tolist()
        spans += 0 < k < len(c.tokens)
    assert spans >= 2
    restarted, got = e.stream(), {}
    restarted.add(reqs)
    for _ in range(2):
        restarted.iterate(gemma2.params, 0)
    assert restarted.drop_stale(1) >= 2
    _drain(restarted, new, 1, got)
    fresh = [i for i, c in got.items() if (c.versions == 1).all()]
    assert len(fresh) >= 2
    for i in fresh:
        assert _same(got[i], new_done[i]), i


@pytest.mark.parametrize("setting", ["greedy", pytest.param("nucleus", marks=pytest.mark.slow)])
def test_the_prefix_cache_changes_no_token_and_no_logprob(gemma2: Tiny, setting: str) -> None:
    """With and without the prefix cache (fp32): a group of 6 completions of one prompt
    through 2 slots (the later ones find the prompt's blocks in the cache), and 3-turn
    trajectories whose next turns find their sequence so far there, sample the same tokens
    with log-probs equal to 1e-5, while the cache computes fewer prefill tokens."""
    reply = list(range(7, 16))

    def run(e: Engine) -> tuple[list[Completion], list[Completion], dict]:
        group = _generate(e, gemma2, [PROMPTS[1]] * 6, list(range(40, 46)))
        turns: dict[int, int] = {}

        def resume(i: int, c: Completion) -> Request | None:
            turns[i] = turns.get(i, 0) + 1
            if turns[i] == 3:
                return None
            r = first[i] if turns[i] == 1 else last[i]
            last[i] = dataclasses.replace(r, prompt=r.prompt + tuple(c.tokens) + tuple(reply),
                                          offset=r.offset + len(c.tokens))
            return last[i]

        first = [e.request(p, s, max_new_tokens=5) for p, s in zip(PROMPTS, SEEDS)]
        last: dict[int, Request] = {}
        return group, e.generate(gemma2.params, first, resume=resume), dict(e.stats)

    on, off = engine(gemma2, setting), engine(gemma2, setting, prefix_cache=False)
    group_on, turns_on, stats_on = run(on)
    group_off, turns_off, stats_off = run(off)
    for a, b in zip(group_on + turns_on, group_off + turns_off):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert stats_on["cached_tokens"] > 0 and stats_off["cached_tokens"] == 0
    assert stats_on["prefill_tokens"] < stats_off["prefill_tokens"]
    assert stats_on["sequence_tokens"] == stats_off["sequence_tokens"]


@pytest.mark.slow
def test_ignore_eos_decodes_every_row_to_its_limit() -> None:
    """rollout.ignore_eos (benchmarks): the rollout engine's stop ids leave EOS out, so a row
    whose path emits EOS decodes on to rollout.max_new_tokens (a seed fixes the sample);
    without it the row ends at EOS, and a rollout.stop string still stops either way."""
    from conftest import TINY_MODEL
    from gpurl.config import MeshConfig, ModelConfig, RolloutConfig
    from gpurl.models import model_spec
    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.rollout.rounds import rollout_engine

    spec = model_spec(ModelConfig(**TINY_MODEL, tokenizer="bytes"))
    rollout = RolloutConfig(max_new_tokens=8, slots=2, block_size=4, ignore_eos=True)
    tok = byte_tokenizer()
    free = rollout_engine(spec, tok, rollout, MeshConfig())
    params = free.place(spec.init(0))
    prompt = Request((tok.bos_id, *tok.encode("12 + 7 =")), 8, 1.0, seed=3)
    path = [int(t) for t in free.generate(params, [prompt])[0].tokens]
    assert len(path) == 8 and free.stop_ids == ()
    # the first token after the first that the path has not emitted before
    k = next(i for i in range(1, 8) if path[i] not in path[:i])
    tok.eos_id = path[k]  # a tokenizer whose EOS this model emits at position k
    stops = rollout_engine(spec, tok, dataclasses.replace(rollout, ignore_eos=False), MeshConfig())
    assert stops.stop_ids == (path[k],)
    assert [int(t) for t in stops.generate(params, [prompt])[0].tokens] == path[:k + 1]
    # with ignore_eos the same EOS is no stop (the engine above decoded past it) ...
    assert rollout_engine(spec, tok, rollout, MeshConfig()).stop_ids == ()
    # ... and a stop string still is: the tokens holding it, EOS not among them
    stopped = rollout_engine(spec, tok, dataclasses.replace(rollout, stop=("7",)), MeshConfig())
    assert stopped.stop_ids == (tok.encode("7")[0],) and tok.eos_id not in stopped.stop_ids
