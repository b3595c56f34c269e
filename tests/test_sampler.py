"""The KV-cache sampler against references written by someone else: transformers' greedy
generation (a tiny random model of every family, and the real Gemma 3 270M), the training
forward pass's log-probabilities, and top-k / nucleus sets computed in NumPy; then stops,
seeds, the number of compiled programs, and sharded == unsharded.

Every `StaticSampler` compiles its own programs (~2 s each for a tiny model on 2 cores), so the
samplers are built once per module and shared; every tiny-model call uses one batch bucket
and one prompt bucket, so each sampler compiles one program.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models
from conftest import TINY_MODEL
from gpurl.algorithms.forward import token_logprobs
from gpurl.config import ConfigError, MeshConfig, ModelConfig, RolloutConfig
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import ModelSpec, model_spec
from gpurl.models.gguf import load_gguf_params, model_config_from_gguf
from gpurl.models.hf import load_hf_params, model_config_from_hf
from gpurl.rollout.programs import Rollout
from gpurl.rollout.static import StaticSampler
from gpurl.rollout.sampling import allowed_logits, sample, sample_rows

MESH = rollout_mesh(MeshConfig(rollout_tp=2))  # data=2, tp=2 over the 4 host devices
ONE_DEVICE = rollout_mesh(MeshConfig(rollout_tp=1), devices=jax.devices()[:1])
RULES = MeshConfig().sample_rules
PAD = 0
N = 8  # new tokens for the tiny models
# 4 rows (one batch bucket), right-padded to one prompt bucket of 16; every prompt +
# completion outruns the sliding window of 4.
_RNG = np.random.default_rng(0)
PROMPTS = [_RNG.integers(3, hf_models.VOCAB, n).tolist() for n in (1, 9, 16, 6)]
SEEDS = [3, 4, 5, 6]
# Sampling settings of the tiny-model tests. Both truncations bind hard: the nucleus keeps
# ~70 of 300 tokens, and the 4 most likely tokens hold ~15% of the mass at temperature 0.7.
SAMPLING = {"greedy": RolloutConfig(max_new_tokens=N, temperature=0.0),
            "nucleus": RolloutConfig(max_new_tokens=N, temperature=1.0, top_p=0.6),
            "top_k": RolloutConfig(max_new_tokens=N, temperature=0.7, top_k=4),
            # the settings users pick (the truncation corrections' test, tests/test_engine.py)
            "top_k_50": RolloutConfig(max_new_tokens=N, temperature=1.0, top_k=50),
            "top_p_0.9": RolloutConfig(max_new_tokens=N, temperature=1.0, top_p=0.9)}
LOGPROB_TOL = 1e-4

# hf_models' weights send Gemma's greedy path into repeating the last token (the sqrt(D)-
# scaled embedding dominates the residual stream and the tied head maps it back to itself).
# A smaller embedding and larger post-norm scales make the path move, with a top-1 margin
# >= 4e-3 at every step, far above the ~1e-5 by which the two implementations differ.
# family -> (embedding factor, added to the post-attention / post-MLP norm weights)
VARY = {"gemma": (0.2, 0.0), "gemma2": (0.5, 4.0), "gemma3": (0.3, 4.0)}


@dataclasses.dataclass
class Tiny:
    family: str
    hf: Any  # the transformers model
    spec: ModelSpec
    params: Any  # on MESH, in the sampling layout
    stop_ids: tuple[int, ...]  # transformers' eos ids for this family
    samplers: dict = dataclasses.field(default_factory=dict)

    def sampler(self, setting: str, mesh: Any = MESH,
                stop_ids: tuple[int, ...] | None = None) -> StaticSampler:
        """One shared StaticSampler per (setting, mesh, stops): each compiles its own programs."""
        stops = self.stop_ids if stop_ids is None else stop_ids
        key = (setting, id(mesh), stops)
        if key not in self.samplers:
            self.samplers[key] = StaticSampler(self.spec, SAMPLING[setting], mesh, RULES,
                                               stop_ids=stops, pad_id=PAD)
        return self.samplers[key]


def _build_tiny(family: str, path: Path) -> Tiny:
    model = hf_models.build(family)
    embed_factor, post_norm = VARY.get(family, (1.0, 0.0))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_factor)
        for name, p in model.named_parameters():
            if "post_" in name and "norm" in name:
                p.add_(post_norm)
    model.save_pretrained(path)
    spec = model_spec(model_config_from_hf(path, ModelConfig(dtype="float32")))
    eos = model.generation_config.eos_token_id
    stops = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    tiny = Tiny(family, model, spec, None, stops)
    tiny.params = load_hf_params(path, spec, tiny.sampler("greedy").param_shardings)
    return tiny


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    built: dict[str, Tiny] = {}

    def get(family: str) -> Tiny:
        if family not in built:
            built[family] = _build_tiny(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def gemma2(tiny_models: Any) -> Tiny:
    """The model of the sampling tests: softcapped logits, a sliding window of 4."""
    return tiny_models("gemma2")


def _rows(rollout: Rollout, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, lengths, logprobs) of the first n rows (the rest fill the batch bucket)."""
    return (np.asarray(rollout.tokens)[:n], np.asarray(rollout.lengths)[:n],
            np.asarray(rollout.logprobs)[:n])


def _hf_greedy(model: Any, prompt: list[int], stops: tuple[int, ...], n: int,
               threads: int | None = None) -> list[int]:
    """transformers' greedy completion of one prompt. threads=1 for tiny models: two threads
    spin on each of their microsecond ops, 20x slower on 2 busy cores."""
    ids = torch.tensor([prompt])
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, eos_token_id=list(stops) or None,
                                 pad_token_id=PAD)
    finally:
        torch.set_num_threads(before)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------- greedy vs transformers


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "qwen3_moe"
                                    else f for f in hf_models.FAMILIES])
def test_greedy_matches_transformers(tiny_models: Any, family: str) -> None:
    tiny = tiny_models(family)
    tokens, lengths, _ = _rows(tiny.sampler("greedy").generate(tiny.params, PROMPTS, SEEDS), 4)
    for i, prompt in enumerate(PROMPTS):
        expected = _hf_greedy(tiny.hf, prompt, tiny.stop_ids, N, threads=1)
        assert tokens[i, :lengths[i]].tolist() == expected, (family, i)
        assert (tokens[i, lengths[i]:] == PAD).all()
    # Not degenerate: the path moves within each row and differs across rows.
    assert min(len(set(row)) for row in tokens.tolist()) >= 2 and len(set(tokens.flat)) >= 12


# Recorded from transformers 5 (AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=
# float32).generate(do_sample=False, max_new_tokens=12), one prompt at a time). Loading that
# reference takes ~40 s on 2 cores; the session fixture is shared with test_gguf.py, and
# test_recorded_transformers_outputs_are_current checks the recording against it live.
# text -> (transformers' tokens, BOS first; transformers' greedy completion)
REAL_NEW = 12
REAL_STOPS = (1,)  # the GGUF's eos: transformers' generation_config.eos_token_id
REAL: dict[str, tuple[list[int], list[int]]] = {
    "2 + 3 = 5\n4 + 1 = 5\n7 + 2 =": (
        [2, 236778, 900, 236743, 236800, 578, 236743, 236810, 107, 236812, 900, 236743, 236770,
         578, 236743, 236810, 107, 236832, 900, 236743, 236778, 578],
        [236743, 236770, 236770, 107, 236770, 236771, 900, 236743, 236800, 578, 236743, 236770]),
    "12 + 30 = 42\n5 + 5 = 10\n21 + 6 =": (
        [2, 236770, 236778, 900, 236743, 236800, 236771, 578, 236743, 236812, 236778, 107,
         236810, 900, 236743, 236810, 578, 236743, 236770, 236771, 107, 236778, 236770, 900,
         236743, 236825, 578],
        [236743, 236778, 236800, 107, 236770, 236778, 900, 236743, 236770, 236778, 578, 236743]),
    "3 + 4 = 7\n8 + 8 = 16\n1 + 1 = 2\n6 + 3 =": (
        [2, 236800, 900, 236743, 236812, 578, 236743, 236832, 107, 236828, 900, 236743, 236828,
         578, 236743, 236770, 236825, 107, 236770, 900, 236743, 236770, 578, 236743, 236778,
         107, 236825, 900, 236743, 236800, 578],
        [236743, 236819, 107, 236770, 900, 236743, 236770, 578, 236743, 236778, 107, 236770]),
    "The river begins as a thin line of meltwater high in the mountains, where": (
        [2, 818, 8858, 12502, 618, 496, 11202, 1757, 529, 24041, 7632, 1494, 528, 506, 13254,
         236764, 1298],
        [625, 17752, 1343, 506, 23844, 529, 506, 8858, 236761, 669, 8858, 563]),
}


@dataclasses.dataclass
class Real:
    spec: ModelSpec
    params: Any
    rollout: Rollout  # greedy completions of REAL's prompts


@pytest.fixture(scope="module")
def real(gemma3_gguf: Path) -> Real:
    spec = model_spec(model_config_from_gguf(gemma3_gguf, ModelConfig(dtype="float32")))
    sampler = StaticSampler(spec, RolloutConfig(temperature=0.0, max_new_tokens=REAL_NEW), MESH, RULES,
                      stop_ids=REAL_STOPS, pad_id=PAD)
    params = load_gguf_params(gemma3_gguf, spec, sampler.param_shardings)
    prompts = [prompt for prompt, _ in REAL.values()]
    return Real(spec, params, sampler.generate(params, prompts, seeds=[0] * len(prompts)))


def test_real_model_greedy_matches_transformers(real: Real) -> None:
    tokens, lengths, _ = _rows(real.rollout, len(REAL))
    for i, (text, (_, expected)) in enumerate(REAL.items()):
        assert tokens[i, :lengths[i]].tolist() == expected, text


def test_recorded_transformers_outputs_are_current(gemma3_hf_model: Any,
                                                   gemma3_hf_tokenizer: Any) -> None:
    for text, (prompt, completion) in REAL.items():
        assert gemma3_hf_tokenizer(text).input_ids == prompt, text
        assert _hf_greedy(gemma3_hf_model, prompt, REAL_STOPS, REAL_NEW) == completion, text


# ------------------------------------------------------------- log-probs vs training pass


def _reference_batch(prompts: list[list[int]], tokens: np.ndarray,
                     lengths: np.ndarray) -> dict[str, jax.Array]:
    """prompt + completion rows, right-padded to a multiple of 16 (segment 0 marks the
    padding), so the reference forward pass compiles once per model."""
    rows = [prompt + tokens[i, :lengths[i]].tolist() for i, prompt in enumerate(prompts)]
    t = -(-max(map(len, rows)) // 16) * 16
    tokens_BxT = np.full((len(rows), t), PAD, np.int32)
    segments_BxT = np.zeros((len(rows), t), np.int32)
    for i, row in enumerate(rows):
        tokens_BxT[i, :len(row)], segments_BxT[i, :len(row)] = row, 1
    positions_BxT = np.broadcast_to(np.arange(t, dtype=np.int32), tokens_BxT.shape)
    return {"tokens": jnp.asarray(tokens_BxT), "positions": jnp.asarray(positions_BxT),
            "segment_ids": jnp.asarray(segments_BxT)}


_JITTED: dict[int, tuple[Any, Any]] = {}


def _jitted(spec: ModelSpec) -> tuple[Any, Any]:
    """(apply, token_logprobs) of the training forward pass, one jit per model."""
    if id(spec) not in _JITTED:
        _JITTED[id(spec)] = (jax.jit(spec.apply), jax.jit(
            lambda p, b, t: token_logprobs(spec.apply, p, b, t), static_argnums=2))
    return _JITTED[id(spec)]


def _training_logprobs(spec: ModelSpec, params: Any, prompts: list[list[int]],
                       rollout: Rollout, temperature: float) -> tuple[list, list]:
    """(sampler's, token_logprobs') log-probs of each row's completion tokens."""
    tokens, lengths, logprobs = _rows(rollout, len(prompts))
    _, fn = _jitted(spec)
    ref_BxT = np.asarray(fn(params, _reference_batch(prompts, tokens, lengths), temperature))
    # token_logprobs[t] scores token t + 1, so completion token j sits at len(prompt) - 1 + j.
    ref = [ref_BxT[i, len(p) - 1:len(p) - 1 + lengths[i]] for i, p in enumerate(prompts)]
    return [logprobs[i, :lengths[i]] for i in range(len(prompts))], ref


def behaviour_logprobs(tiny: Tiny, rollout: Rollout, cfg: RolloutConfig) -> tuple[list, list]:
    """(the sampler's log-probs of each row's completion tokens, the reference: the
    training forward's log_softmax(logits / temperature) over the whole vocabulary, whatever
    top-k / top-p set the token was drawn from). When `cfg` truncates, the truncated
    distribution's log-probs (NumPy) differ from the reference by log S > 1e-3 on every
    token, so a sampler that recorded those would fail the comparison."""
    ours, full = _training_logprobs(tiny.spec, tiny.params, PROMPTS, rollout, cfg.temperature)
    if not cfg.temperature or not (cfg.top_k or cfg.top_p < 1.0):
        return ours, full
    tokens, lengths, _ = _rows(rollout, len(PROMPTS))
    truncated = [np.zeros(n) for n in lengths]
    for i, j, scaled_V, allowed in _drawn(tiny, tokens, lengths, cfg):
        kept = scaled_V[sorted(allowed)].astype(np.float64)
        truncated[i][j] = scaled_V[tokens[i, j]] - kept.max() - np.log(np.exp(kept - kept.max()).sum())
    assert min(float((t - f).min()) for t, f in zip(truncated, full)) > 1e-3
    return ours, full


def _max_diff(ours: list, ref: list) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))


@pytest.mark.parametrize("setting", ["greedy", pytest.param("nucleus", marks=pytest.mark.slow),
                                     pytest.param("top_k", marks=pytest.mark.slow)])
def test_logprobs_match_training_forward(gemma2: Tiny, setting: str) -> None:
    """The log-prob of the policy that samples, the one the trainer computes: the training
    forward's log_softmax(logits / temperature) (log_softmax(logits) when greedy) over the
    whole vocabulary, also where top-k / top-p chose the set drawn from."""
    rollout = gemma2.sampler(setting).generate(gemma2.params, PROMPTS, SEEDS)
    ours, ref = behaviour_logprobs(gemma2, rollout, SAMPLING[setting])
    diff = _max_diff(ours, ref)
    print(f"\ngemma2 {setting}: max |logprob diff| = {diff:.2e}")
    assert diff < LOGPROB_TOL
    _, lengths, logprobs = _rows(rollout, len(PROMPTS))
    assert all((logprobs[i, n:] == 0).all() for i, n in enumerate(lengths))
    assert all((lp < -1e-3).all() for lp in ours)  # a real distribution, not a one-hot


def test_real_model_logprobs_match_training_forward(real: Real) -> None:
    prompts = [prompt for prompt, _ in REAL.values()]
    ours, ref = _training_logprobs(real.spec, real.params, prompts, real.rollout, 0.0)
    diff = _max_diff(ours, ref)
    print(f"\nGemma 3 270M greedy: max |logprob diff| = {diff:.2e}")
    assert diff < LOGPROB_TOL


# ------------------------------------------------------------------------ top-k / top-p


def _softmax64(logits_V: np.ndarray) -> np.ndarray:
    z = np.exp(logits_V.astype(np.float64) - logits_V.max())
    return z / z.sum()


def _allowed_np(logits_V: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """Top-k: the k largest logits (ties with the k-th kept). Top-p (Holtzman et al. 2020,
    eq. 2): the smallest set of most likely tokens whose probability reaches p, over the
    top-k set renormalized (ties with its least likely token kept)."""
    allowed = np.ones(logits_V.shape, bool)
    if 0 < top_k < logits_V.size:
        allowed &= logits_V >= np.sort(logits_V)[-top_k]
    if top_p < 1.0:
        probs = np.where(allowed, _softmax64(np.where(allowed, logits_V, -np.inf)), 0.0)
        sorted_probs = np.sort(probs)[::-1]
        last = int(np.searchsorted(np.cumsum(sorted_probs), top_p))  # first cum >= p
        allowed &= probs >= sorted_probs[last]
    return set(np.flatnonzero(allowed).tolist())


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (40, 0.9), (1, 1.0), (0, 0.01)])
def test_allowed_logits_match_numpy(top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(top_k)
    logits_BxV = np.round(rng.normal(0.0, 2.0, (32, 64)), 1).astype(np.float32)  # with ties
    kept_BxV = np.isfinite(np.asarray(allowed_logits(jnp.asarray(logits_BxV), top_k, top_p)))
    for row, kept in zip(logits_BxV, kept_BxV):
        assert set(np.flatnonzero(kept).tolist()) == _allowed_np(row, top_k, top_p)


def _drawn(tiny: Tiny, tokens: np.ndarray, lengths: np.ndarray, cfg: RolloutConfig):
    """(row, completion token index, the training forward's logits / temperature before
    it, its top-k / top-p set in NumPy) of every drawn token."""
    temperature = cfg.temperature
    batch = _reference_batch(PROMPTS, tokens, lengths)
    apply, _ = _jitted(tiny.spec)
    logits_BxTxV = np.asarray(apply(tiny.params, batch["tokens"], batch["positions"],
                                    batch["segment_ids"]))
    for i, prompt in enumerate(PROMPTS):
        for j in range(lengths[i]):
            scaled_V = logits_BxTxV[i, len(prompt) - 1 + j] / temperature
            yield i, j, scaled_V, _allowed_np(scaled_V, cfg.top_k, cfg.top_p)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (40, 0.9), (0, 1.0)])
def test_recorded_logprob_is_the_whole_tempered_softmaxs(top_k: int, top_p: float) -> None:
    """Both samplers draw from the top-k / top-p set and record log p(token) under the whole
    softmax(logits / T) (NumPy), not renormalized over the set; greedy rows of
    `sample_rows` under softmax(logits)."""
    rng = np.random.default_rng(7 + top_k)
    temperature = 0.8
    logits_BxV = rng.normal(0.0, 3.0, (16, 64)).astype(np.float32)
    keys_B = jax.random.split(jax.random.key(top_k), 16)
    greedy_B = np.arange(16) % 4 == 0
    fixed = jax.jit(sample, static_argnums=(2, 3, 4))(logits_BxV, keys_B, temperature, top_k, top_p)
    rows = jax.jit(sample_rows, static_argnums=(5, 6))(
        logits_BxV, keys_B, np.where(greedy_B, 0.0, temperature).astype(np.float32),
        np.full(16, top_k, np.int32), np.full(16, top_p, np.float32), True, top_k > 0 or top_p < 1.0)
    for name, (tokens_B, logprobs_B) in {"sample": fixed, "sample_rows": rows}.items():
        for b, (token, logprob) in enumerate(zip(np.asarray(tokens_B), np.asarray(logprobs_B))):
            if name == "sample_rows" and greedy_B[b]:
                probs, allowed = _softmax64(logits_BxV[b]), set(range(64))
            else:
                scaled = logits_BxV[b] / temperature
                probs, allowed = _softmax64(scaled), _allowed_np(scaled, top_k, top_p)
            assert token in allowed, (name, b)
            expected = np.log(probs[token])
            np.testing.assert_allclose(logprob, expected, rtol=0, atol=1e-5, err_msg=f"{name} {b}")


@pytest.mark.parametrize("setting", ["top_k", "nucleus"])
def test_sampled_tokens_lie_in_allowed_set(gemma2: Tiny, setting: str) -> None:
    cfg = SAMPLING[setting]
    tokens, lengths, _ = _rows(gemma2.sampler(setting).generate(gemma2.params, PROMPTS, SEEDS), 4)
    log_all_in_set_untruncated, not_top1 = 0.0, 0
    for i, j, scaled_V, allowed in _drawn(gemma2, tokens, lengths, cfg):
        assert tokens[i, j] in allowed, (i, j, len(allowed))
        log_all_in_set_untruncated += np.log(_softmax64(scaled_V)[sorted(allowed)].sum())
        not_top1 += tokens[i, j] != scaled_V.argmax()
    # Power: sampling without truncation would have kept every draw inside its set with
    # chance exp(log_all_in_set_untruncated); and the draws are not all the argmax.
    print(f"\n{setting}: log P(untruncated draws all in set) = {log_all_in_set_untruncated:.1f}")
    assert log_all_in_set_untruncated < np.log(1e-5)
    assert not_top1 >= 8, not_top1


def test_seeds_fix_the_sample(gemma2: Tiny) -> None:
    sampler = gemma2.sampler("nucleus")
    first = _rows(sampler.generate(gemma2.params, PROMPTS, seeds=[7, 8, 9, 10]), 4)
    again = _rows(sampler.generate(gemma2.params, PROMPTS, seeds=[7, 8, 9, 10]), 4)
    other = _rows(sampler.generate(gemma2.params, PROMPTS, seeds=[11, 12, 13, 14]), 4)
    # A row's sample follows its own seed, not its place in the batch.
    swapped = _rows(sampler.generate(gemma2.params, PROMPTS[::-1], seeds=[10, 9, 8, 7]), 4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first, swapped):
        np.testing.assert_allclose(a, b[::-1], atol=1e-6)
    assert all((first[0][i] != other[0][i]).any() for i in range(4))


@pytest.mark.slow
def test_repeated_prompts_prefill_once_and_sample_the_same(gemma2: Tiny) -> None:
    """An RL batch repeats each prompt G times: `prepare` finds the runs and the prompt is
    prefilled once per run (its KV cache repeated), with the tokens and log-probs of
    prefilling every row."""
    from gpurl.rollout.static import Prepared

    sampler = gemma2.sampler("nucleus")
    prompts = [PROMPTS[1]] * 4 + [PROMPTS[3]] * 4
    seeds = list(range(20, 28))
    shared = sampler.prepare(prompts, seeds)
    assert shared.group == 4
    per_row = Prepared(tuple(shared), 1)
    a = _rows(sampler.generate_prepared(gemma2.params, shared), 8)
    b = _rows(sampler.generate_prepared(gemma2.params, per_row), 8)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_allclose(a[2], b[2], atol=2e-6)
    assert sampler.prepare(PROMPTS, SEEDS).group == 1


# -------------------------------------------------------------------------------- stops


def test_stop_ids_end_rows_independently(gemma2: Tiny) -> None:
    free = gemma2.sampler("greedy").generate(gemma2.params, PROMPTS, SEEDS)
    ref_tokens, ref_lengths, ref_logprobs = _rows(free, 4)
    assert (ref_lengths == N).all()  # eos never comes: the greedy paths run free
    stops = (int(ref_tokens[0, 0]), int(ref_tokens[2, 2]))
    # Row i stops at the first stop token of its free-running path (that token included).
    first_hit = [np.flatnonzero(np.isin(row, stops)) for row in ref_tokens]
    expected = np.array([h[0] + 1 if h.size else N for h in first_hit])
    # What this exercises: a stop on the first token, stops mid-way, a row that never stops,
    # and each stop id ending some row.
    assert expected[0] == 1 and N in expected and ((1 < expected) & (expected < N)).any()
    assert {int(ref_tokens[i, n - 1]) for i, n in enumerate(expected) if n < N} == set(stops)

    sampler = gemma2.sampler("greedy", stop_ids=stops)
    tokens, lengths, logprobs = _rows(sampler.generate(gemma2.params, PROMPTS, SEEDS), 4)
    np.testing.assert_array_equal(lengths, expected)
    for i, n in enumerate(expected):
        np.testing.assert_array_equal(tokens[i, :n], ref_tokens[i, :n])
        np.testing.assert_array_equal(tokens[i, n:], PAD)
        np.testing.assert_allclose(logprobs[i, :n], ref_logprobs[i, :n], atol=1e-6)
        np.testing.assert_array_equal(logprobs[i, n:], 0.0)


def test_empty_prompt_is_a_clear_error(gemma2: Tiny) -> None:
    with pytest.raises(ConfigError, match="a prompt is empty") as err:
        gemma2.sampler("greedy").generate(gemma2.params, [[5, 6], []], seeds=[0, 1])
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


# ----------------------------------------------------------------------- compile count


@pytest.mark.slow
def test_compiles_bounded_by_buckets() -> None:
    """30 calls over batch sizes 1..8 and prompt lengths 1..60 on a data=4 mesh: batches pad
    to 4 or 8 rows, prompts to 16, 32 or 64 tokens, so at most 2 x 3 = 6 programs."""
    spec = model_spec(ModelConfig(**{**TINY_MODEL, "num_layers": 1}))
    sampler = StaticSampler(spec, RolloutConfig(temperature=0.0, max_new_tokens=2),
                      rollout_mesh(MeshConfig(rollout_tp=1)), RULES, stop_ids=(), pad_id=PAD)
    rng = np.random.default_rng(0)
    # Host-drawn weights: tracing spec.init would cost more than the whole test.
    params = jax.tree.map(lambda x, sharding: jax.device_put(
        rng.normal(0.0, 0.2, x.shape).astype(x.dtype), sharding),
        spec.abstract_params, sampler.param_shardings)

    def call(batch: int, longest: int) -> None:
        prompts = [rng.integers(3, 259, rng.integers(1, longest + 1)).tolist()
                   for _ in range(batch)]
        prompts[0] = [5] * longest
        out = sampler.generate(params, prompts, seeds=range(batch))
        assert out.tokens.shape == (4 if batch <= 4 else 8, 2)

    call(3, 10)
    call(1, 16)  # the same buckets: no new program
    assert sampler.num_compiles() == 1
    call(5, 17)
    assert sampler.num_compiles() == 2
    for _ in range(28):
        call(int(rng.integers(1, 9)), int(rng.integers(1, 61)))
    print(f"\n30 calls compiled {sampler.num_compiles()} programs")
    assert sampler.num_compiles() <= 6


# ------------------------------------------------------------------- sharded == unsharded


@pytest.mark.parametrize("setting", ["greedy", pytest.param("nucleus", marks=pytest.mark.slow)])
def test_sharded_equals_unsharded(gemma2: Tiny, setting: str) -> None:
    """(data=2, tp=2) against one device; the nucleus sorts logits that tp splits."""
    single = gemma2.sampler(setting, ONE_DEVICE)
    a = _rows(gemma2.sampler(setting).generate(gemma2.params, PROMPTS, SEEDS), 4)
    b = _rows(single.generate(single.place(gemma2.params), PROMPTS, SEEDS), 4)
    embed = gemma2.params["embed"]
    assert len(embed.sharding.device_set) == 4 and not embed.sharding.is_fully_replicated
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_allclose(a[2], b[2], atol=1e-5)


def test_real_model_engine_matches_transformers(real: Real) -> None:
    """The rollout engine (continuous batching, paged KV cache of 8-token blocks, two
    slots per shard so requests queue) on the real model: transformers' greedy tokens, and
    the static sampler's log-probs."""
    from gpurl.rollout.engine import Engine

    cfg = RolloutConfig(temperature=0.0, max_new_tokens=REAL_NEW, block_size=8, slots=2,
                        decode_chunk=5)
    engine = Engine(real.spec, cfg, MESH, RULES, stop_ids=REAL_STOPS, pad_id=PAD)
    prompts = [prompt for prompt, _ in REAL.values()]
    done = engine.generate(real.params, [engine.request(p, 0) for p in prompts])
    _, lengths, logprobs = _rows(real.rollout, len(REAL))
    for i, (text, (_, expected)) in enumerate(REAL.items()):
        assert done[i].tokens.tolist() == expected, text
        np.testing.assert_allclose(done[i].logprobs, logprobs[i, :lengths[i]], atol=LOGPROB_TOL)
