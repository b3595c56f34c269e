"""Vision-language models, first part (issue 67): Gemma 3's SigLIP tower and projector
(`gpurl.models.vision`) against transformers' `Gemma3ForConditionalGeneration` image
features, and the image preprocessing (`gpurl.data.images`) against transformers'
`Gemma3ImageProcessorPil` on the same images; bad images in one sentence each."""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import hf_models
from gpurl.config import ConfigError, MeshConfig, ModelConfig, VisionConfig
from gpurl.data.images import gemma3_pixels, open_image, qwen_pixels
from gpurl.distributed.mesh import trainer_mesh, tree_shardings
from gpurl.kernels.attention import attention
from gpurl.models import model_spec
from gpurl.models.hf import load_hf_params, model_config_from_hf
from gpurl.models.transformer import init_cache
from gpurl.models.vision import VisionSpec, image_features, image_sees, init_params, load_hf, place_images

# A tiny Gemma 3 multimodal checkpoint: 64-pixel images in 8-pixel patches (8 x 8 = 64
# patches), pooled to 16 image tokens (4 x 4, a 2 x 2 pool)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=64, patch_size=8, layer_norm_eps=1e-6)
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=24)


@pytest.fixture(scope="module")
def gemma3_vlm():
    torch.manual_seed(0)
    config = transformers.Gemma3Config(vision_config=VISION, text_config=TEXT,
                                       mm_tokens_per_image=16)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero; draw every tensor at random
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return config, model


# The same with hf_models' Gemma 3 text model (sliding window 4 < an image's 16 tokens,
# linear RoPE scaling on the global layers) and image tokens inside its vocabulary.
IMAGE, BOI, EOI = 290, 291, 292


@pytest.fixture(scope="module")
def gemma3_vlm_dir(tmp_path_factory):
    _, text = hf_models.FAMILIES["gemma3"]
    config = transformers.Gemma3Config(
        vision_config=VISION, text_config={**hf_models.COMMON, **text, "max_position_embeddings": 128},
        mm_tokens_per_image=16, image_token_index=IMAGE, boi_token_index=BOI,
        eoi_token_index=EOI)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    hf_models._redraw(model, gemma=True)
    path = tmp_path_factory.mktemp("gemma3_vlm")
    model.save_pretrained(path)
    return model, path


def _image_block() -> list[int]:
    return [BOI] + [IMAGE] * 16 + [EOI]


def _vlm_rows() -> list[list[int]]:
    """Row 0: one image in a prompt; row 1: a chat whose user turns each hold an image
    (`<start_of_turn>` 105, `<end_of_turn>` 106 in Gemma's vocabulary are plain ids here);
    row 2: text only."""
    rng = np.random.default_rng(1)

    def text(n: int) -> list[int]:
        return rng.integers(3, 280, n).tolist()

    return [[2] + text(3) + _image_block() + text(4),
            [2, 105] + text(2) + _image_block() + text(2) + [106, 105] + text(3) + [106, 105]
            + _image_block() + text(1) + _image_block() + [106],
            [2] + text(9)]


def _pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    t = max(map(len, rows))
    tokens = np.zeros((len(rows), t), np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for b, r in enumerate(rows):
        tokens[b, :len(r)], mask[b, :len(r)] = r, 1
    return tokens, mask


def _gpurl_vlm(path):
    """The checkpoint as a vision-language model (its text model and tower, read by
    `load_hf_params` onto a 4-device mesh)."""
    cfg = model_config_from_hf(path, ModelConfig(dtype="float32", vocab_size=262208,
                                                  vision=VisionConfig(layers=1)))
    spec = model_spec(cfg)
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=2, tp=2))
    shardings = tree_shardings(spec.abstract_params, spec.logical_axes, MeshConfig().train_rules, mesh)
    return cfg, spec, load_hf_params(path, spec, shardings)


@pytest.mark.slow  # transformers' model: 10 s on 2 cores
def test_gemma3_vlm_logits_and_greedy_generation_equal_transformers(gemma3_vlm_dir):
    """Gemma 3's language model with images (fp32, 2e-4 on logits of magnitude ~10):
    image features placed at the image tokens, image tokens seeing their whole image in
    global and sliding-window layers; one image, a chat with three images (two in one
    turn) and a text-only row in one right-padded batch; and greedy generation after an
    image prompt through the KV cache equal to transformers' `generate`."""
    model, path = gemma3_vlm_dir
    cfg, spec, params = _gpurl_vlm(path)
    assert (cfg.vision.layers, cfg.vision.tokens, cfg.vision.image_token_id) == (2, 16, IMAGE)
    images = _images()
    pixels = np.stack([gemma3_pixels(im, 64) for im in images])  # equal to HF's: test above
    rows = _vlm_rows()
    tokens, mask = _pad(rows)
    blank = np.full_like(pixels[0], 7.0)  # an unused image slot: never read
    row_pixels = np.stack([np.stack([pixels[0], blank, blank]), pixels[1:],
                           np.stack([blank] * 3)])  # B x M x C x H x W, each row's images in order
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                         pixel_values=torch.from_numpy(pixels),
                         token_type_ids=torch.from_numpy((tokens == IMAGE).astype(np.int64))
                         ).logits.numpy()

    @jax.jit
    def logits(params, pixels, tokens, segments):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return spec.apply(params, tokens, positions, segments, pixels)

    got = np.asarray(logits(params, row_pixels, tokens.astype(np.int32), mask.astype(np.int32)))
    valid = mask.astype(bool)
    diff = np.abs(got - expected)[valid].max()
    assert diff < 2e-4 * max(1.0, np.abs(expected).max() / 10), diff
    # a causal mask over the images instead would be far off
    causal = np.asarray(jax.jit(spec.apply)(params, jnp.asarray(tokens, jnp.int32),
                                            jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
                                            jnp.asarray(mask, jnp.int32)))
    assert np.abs(causal[2] - expected[2])[valid[2]].max() < 2e-4 * max(1.0, np.abs(expected).max() / 10)

    # greedy generation of row 1 (three images) through the KV cache
    prompt, new = np.asarray(rows[1]), 6
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.from_numpy(prompt[None]),
                                pixel_values=torch.from_numpy(pixels[1:]),
                                token_type_ids=torch.from_numpy((prompt[None] == IMAGE).astype(np.int64)),
                                max_new_tokens=new, do_sample=False)[0, len(prompt):].numpy()

    ours, _ = _reference_greedy(cfg, spec, params, rows[1], pixels[1:], new)
    np.testing.assert_array_equal(ours, theirs)


def test_image_tokens_see_their_whole_image_and_take_their_rows_features():
    """`image_sees` and `place_images` on hand-made rows: two images back to back in one
    run would be one block (as transformers' `token_type_ids` blocks are), an image at the
    row's end, padding; and the flash kernel path hands calls with image blocks to `xla`."""
    tokens = jnp.asarray([[5, 9, 9, 9, 5, 9, 9, 0],
                          [9, 9, 5, 5, 5, 5, 9, 9]])
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 0],
                             [10, 11, 12, 13, 14, 15, 16, 17]])
    is_image = tokens == 9
    np.testing.assert_array_equal(image_sees(is_image, positions),
                                  [[0, 3, 3, 3, 4, 6, 6, 0], [11, 11, 12, 13, 14, 15, 17, 17]])
    images = jnp.arange(2 * 5 * 1, dtype=jnp.float32).reshape(2, 5, 1) + 100
    placed = place_images(jnp.zeros((2, 8, 1)), is_image, images)[..., 0]
    np.testing.assert_array_equal(placed, [[0, 100, 101, 102, 0, 103, 104, 0],
                                           [105, 106, 0, 0, 0, 0, 107, 108]])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.float32) for _ in range(3))
    segments = (tokens > 0).astype(jnp.int32)
    sees = image_sees(is_image, positions)
    kw = dict(scale=0.5, window=3, q_sees_BxT=sees)
    xla = attention(q, k, v, positions, segments, positions, segments, **kw)
    pallas = attention(q, k, v, positions, segments, positions, segments, implementation="pallas", **kw)
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(pallas))
    causal = attention(q, k, v, positions, segments, positions, segments, scale=0.5, window=3)
    # the first image's tokens see ahead; the text token after it sees what it saw before
    assert np.abs(np.asarray(xla - causal))[0, 1:3].min() > 0
    np.testing.assert_array_equal(np.asarray(xla)[0, 4], np.asarray(causal)[0, 4])


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, c), np.uint8).squeeze(), mode)
            for h, w, c, mode in ((64, 64, 3, "RGB"), (37, 90, 3, "RGB"), (120, 50, 4, "RGBA"),
                                  (30, 30, 1, "L"))]


@pytest.mark.slow  # transformers' import and model: 8 s on 2 cores
def test_gemma3_image_features_equal_transformers(gemma3_vlm):
    """The tower and projector loaded from the checkpoint's tensors give transformers'
    image features (fp32, 1e-5) for images of several sizes, preprocessed by each side's
    own code."""
    config, model = gemma3_vlm
    spec = VisionSpec.from_hf(config.to_dict())
    assert (spec.patches_per_side, spec.tokens, spec.text_width) == (8, 16, 48)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    params = load_hf(spec, state)
    images = _images()
    processor = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 64, "width": 64})
    theirs = processor(images=images, return_tensors="np")["pixel_values"]
    ours = np.stack([gemma3_pixels(im, 64) for im in images])
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    with torch.no_grad():
        expected = model.get_image_features(torch.from_numpy(theirs)).pooler_output.numpy()
    got = np.asarray(jax.jit(lambda p, x: image_features(p, spec, x))(params, jnp.asarray(ours)))
    assert got.shape == expected.shape == (4, 16, 48)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_random_towers_have_the_loaded_shapes(gemma3_vlm):
    config, model = gemma3_vlm
    spec = VisionSpec.from_hf(config.to_dict())
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    loaded = load_hf(spec, state)
    drawn = init_params(spec, seed=0)
    assert jax.tree.map(jnp.shape, loaded) == jax.tree.map(jnp.shape, drawn)
    # the Hub files' naming: vision_tower.vision_model.*, multi_modal_projector.*
    hub = {k.replace("model.vision_tower.", "vision_tower.vision_model.")
            .replace("model.multi_modal_projector.", "multi_modal_projector."): v
           for k, v in state.items()}
    from_hub = load_hf(spec, hub)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), loaded, from_hub)))


@pytest.mark.slow  # transformers' import
def test_qwen_pixels_and_grids_equal_transformers_processor():
    """Qwen2-VL's dynamic resolution: images scaled down into the pixel budget, up to its
    floor, or only rounded, give transformers' pixel values (its patch order) and grids."""
    images = _images() + [Image.fromarray(np.full((300, 500, 3), 200, np.uint8))]
    budget = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    processor = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        size={"shortest_edge": budget["min_pixels"], "longest_edge": budget["max_pixels"]})
    theirs = processor(images=images, return_tensors="np")
    ours = [qwen_pixels(im, **budget) for im in images]
    np.testing.assert_array_equal(np.asarray([o.grid for o in ours]), theirs["image_grid_thw"])
    np.testing.assert_allclose(np.concatenate([o.patches for o in ours]),
                               theirs["pixel_values"], atol=1e-5)
    assert [o.tokens for o in ours] == [int(np.prod(g)) // 4 for g in theirs["image_grid_thw"]]
    assert all(4 <= o.tokens <= 16 for o in ours)  # 28 x 28 pixels per image token


def test_an_image_too_narrow_for_the_budget_is_one_sentence():
    with pytest.raises(ConfigError, match=r"^row 3's image is 1000 x 4 pixels, more than 200 "
                                          r"times as wide as high \(or high as wide\); crop it "
                                          r"before training\.$"):
        qwen_pixels(Image.new("RGB", (1000, 4)), where="row 3's image")


def _png(size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("source, message", [
    ("missing.png", r"^row 3's image: missing.png does not exist; fix the path .*\.$"),
    (b"", r"^row 3's image is empty or not an image .*; give the image's file path or its bytes\.$"),
    (_png()[:40], r"^row 3's image could not be decoded \(\w+\); give a complete PNG, JPEG, GIF or WebP file\.$"),
    ({"caption": "x"}, r"^row 3's image is a dict without \"bytes\" or \"path\"; .*\.$"),
], ids=["missing", "empty", "truncated", "no_bytes"])
def test_bad_images_are_one_sentence(source, message):
    with pytest.raises(ConfigError, match=message):
        open_image(source, "row 3's image")


def test_a_huge_image_is_refused_before_it_is_decoded(tmp_path):
    """A PNG whose header claims 20,000 x 20,000 pixels: refused from its header alone."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", 20_000, 20_000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    with pytest.raises(ConfigError, match=r"^row 3's image has more than 178,956,970 pixels "
                                          r"\(or none\); resize it before training\.$"):
        open_image(png, "row 3's image")
    path = tmp_path / "ok.png"
    path.write_bytes(_png((5, 3)))
    assert open_image(str(path)).size == open_image({"bytes": _png((5, 3))}).size == (5, 3)


# ---------------------------------------------------------------- data with images


def _tokenizer():
    from gpurl.models.loading import load_tokenizer
    return load_tokenizer(ModelConfig(name="tiny_vlm", vocab_size=262, tokenizer="bytes",
                                      vision=VisionConfig(layers=1, image_size=32, patch=4,
                                                          tokens=16, image_token_id=259,
                                                          boi_token_id=260, eoi_token_id=261)))


def test_image_parts_and_markers_become_the_models_image_tokens():
    """Content parts (OpenAI's and TRL's) flatten to text with the image marker, images come
    from the `images` column or from the parts themselves (a data URL decoded), and each
    marker becomes "\\n\\n" + begin + 16 image tokens + end + "\\n\\n" in the token ids;
    rows of packed examples keep their examples' images in order."""
    import base64

    from gpurl.config import DataConfig
    from gpurl.data.layouts import converter
    from gpurl.data.sft import encode_sft

    png = _png((5, 4))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    convert, keys = converter(["messages", "images"], DataConfig(), "examples", "f.jsonl")
    assert keys == ["messages", "images"]
    row = convert({"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]},
        {"role": "assistant", "content": "3"}], "images": ["a.png"]}, "row 0")
    assert row["prompt"] == "<start_of_image>Count." and row["images"] == ["a.png"]
    inline, _ = converter(["messages"], DataConfig(), "examples", "f.jsonl")
    row = inline({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "A"},
                                     {"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "B"}]}, "row 1")
    assert row["prompt"] == "A<start_of_image>" and row["images"] == [png]

    tokenizer = _tokenizer()
    ids, counts = tokenizer.images.encode(["x<start_of_image>y<start_of_image>", "z"],
                                          tokenizer.encode_batch)
    block = [260] + [259] * 16 + [261]
    nl = tokenizer.encode("\n\n")
    assert counts == [2, 0]
    assert ids[0] == (tokenizer.encode("x") + nl + block + nl + tokenizer.encode("y") + nl
                      + block + nl)
    assert ids[1] == tokenizer.encode("z")

    examples = [{"prompt": "<start_of_image>a", "completion": " b", "images": [png]},
                {"prompt": "<start_of_image>c<start_of_image>", "completion": " d",
                 "images": [_png((3, 3)), png]},
                {"prompt": "e", "completion": " f"}]
    # 27, 49 and 5 tokens: first fit puts the third beside the first
    rows = encode_sft(examples, tokenizer, DataConfig(max_len=64, packing=True))
    assert len(rows) == 2 and rows.images == ((png,), tuple(examples[1]["images"]))
    assert (rows.tokens == 259).sum(axis=1).tolist() == [16, 32]
    pixels = rows.pixels(np.arange(2))
    assert pixels.shape == (2, 2, 3, 32, 32)
    np.testing.assert_array_equal(pixels[1, 1], gemma3_pixels(open_image(png), 32))
    assert not pixels[0, 1].any()


@pytest.mark.parametrize("examples, max_len, message", [
    ([{"prompt": "<start_of_image>a", "completion": " b", "images": []},
      {"prompt": "a", "completion": " b", "images": [b"x"]}], 64,
     r"^example 0 gives 0 image\(s\) but its prompt places 1 \(an image part or "
     r"<start_of_image> marks each\); give one image per image part\.$"),
    ([{"prompt": "0123456789<start_of_image>", "completion": " b", "images": [b"x"]}], 24,
     r"^example 0's images end past data.max_len=24 tokens \(16 per image\); raise "
     r"data.max_len or give fewer images per example\.$"),
], ids=["count", "too_long"])
def test_rows_whose_images_do_not_fit_are_one_sentence(examples, max_len, message):
    from gpurl.config import DataConfig
    from gpurl.data.sft import encode_sft

    with pytest.raises(ConfigError, match=message):
        encode_sft(examples, _tokenizer(), DataConfig(max_len=max_len))


def test_images_for_a_text_model_are_one_sentence():
    from gpurl.config import DataConfig
    from gpurl.data.sft import encode_sft
    from gpurl.models.tokenizer import byte_tokenizer

    with pytest.raises(ConfigError, match=r"^the data has images but the model is a text "
                                          r"model; .*\.$"):
        encode_sft([{"prompt": "<start_of_image>a", "completion": " b", "images": [b"x"]}],
                   byte_tokenizer(), DataConfig())


TINY_VLM = dict(name="tiny_vlm", family="gemma3", vocab_size=262, d_model=32, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, dtype="float32",
                post_norms=True, qk_norm=True, tokenizer="bytes",
                vision=VisionConfig(layers=1, width=32, heads=2, mlp_dim=64, image_size=32,
                                    patch=4, tokens=16, image_token_id=259, boi_token_id=260,
                                    eoi_token_id=261))


@pytest.mark.e2e
def test_sft_on_images_trains_the_language_model_and_keeps_the_tower_frozen(tmp_path):
    """`gpurl train algo=sft` on the quadrant task with a tiny vision-language model: rows
    carry their images to the train step and to held-out batches (the last one padded),
    the language model learns while the tower (model.vision.trainable=false) stays as it
    was drawn, checkpoint to checkpoint."""
    from conftest import make_config
    from gpurl.train.loop import train
    from gpurl.train.restore import restore_run

    cfg = make_config(model=TINY_VLM, data={"name": "quadrant", "max_len": 96, "num_train": 32,
                                            "num_eval": 12},
                      optim={"lr": 3e-3, "warmup_steps": 0}, logger={"progress": False},
                      train={"steps": 4, "batch_size": 8, "eval_every": 2, "eval_batch_size": 8,
                             "checkpoint_every": 2, "keep_checkpoints": 2},
                      run={"dir": str(tmp_path / "run")})
    summary = train(cfg)
    assert summary["finished"] and 0 < summary["eval/loss"] < 10
    (_, early), (_, late) = restore_run(tmp_path / "run", 2), restore_run(tmp_path / "run", 4)
    assert set(late["vision"]) == {"tower", "projector"}
    for a, b in zip(jax.tree.leaves(early["vision"]), jax.tree.leaves(late["vision"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(early["embed"]) - np.asarray(late["embed"])).max() > 0


def test_prompts_and_pairs_with_images_that_cannot_run_are_one_sentence():
    """RL prompts expand their images for a vision-language model; for a text model, or
    with fewer image parts than images, one sentence; preference pairs with images (not
    built yet) one sentence too."""
    from gpurl.config import DataConfig
    from gpurl.data.preferences import encode_pairs
    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.rollout.prompts import encode_prompts

    row = {"prompt": "<start_of_image>Which?", "answer": "a", "images": [_png()],
           "chosen": " a", "rejected": " b"}
    prompts, _ = encode_prompts([row], _tokenizer(), False, 64, "train")
    assert prompts.tokens[0].count(259) == 16 and prompts.pixels_shape == (1, 3, 32, 32)
    pixels, key = prompts.images(0)
    np.testing.assert_array_equal(pixels[0], gemma3_pixels(open_image(_png()), 32))
    assert prompts.images(0)[1] == key and len(key) == 32
    with pytest.raises(ConfigError, match=r"^train prompts have images but the model is a "
                                          r"text model; .*\.$"):
        encode_prompts([row], byte_tokenizer(), False, 64, "train")
    with pytest.raises(ConfigError, match=r"^eval prompt 0 gives 2 image\(s\) but places 1 "):
        encode_prompts([{**row, "images": [_png(), _png()]}], _tokenizer(), False, 64, "eval")
    with pytest.raises(ConfigError, match=r"^train pairs have images, .*\.$"):
        encode_pairs([row], _tokenizer(), DataConfig(), "train")


@pytest.mark.slow
def test_a_vision_language_model_exports_to_what_transformers_and_gpurl_load(gemma3_vlm_dir, tmp_path):
    """`export_hf` of a vision-language model writes Gemma3ForConditionalGeneration's
    tensors and config: transformers loads it and gives the original's logits with images
    (fp32, 1e-5), and gpurl reads back the same config and parameters."""
    from gpurl.models.hf_export import export_hf

    model, path = gemma3_vlm_dir
    cfg, spec, params = _gpurl_vlm(path)
    export_hf(params, cfg, tmp_path / "out")
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "out", dtype=torch.float32).eval()
    tokens = np.asarray([_vlm_rows()[0]])
    pixels = torch.from_numpy(gemma3_pixels(_images()[1], 64)[None])
    kw = dict(input_ids=torch.from_numpy(tokens), pixel_values=pixels,
              token_type_ids=torch.from_numpy((tokens == IMAGE).astype(np.int64)))
    with torch.no_grad():
        np.testing.assert_allclose(again(**kw).logits.numpy(), model(**kw).logits.numpy(),
                                   rtol=1e-5, atol=1e-5)
    cfg2, _, params2 = _gpurl_vlm(tmp_path / "out")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _reference_greedy(cfg, spec, params, prompt, pixels, new):
    """(greedy tokens, their log-probs) through the model's own KV cache (equal to
    transformers' `generate`: the first test)."""
    @jax.jit
    def run(params, pixels, prompt):
        t = prompt.shape[1]
        cache = init_cache(cfg, 1, t + new)
        hidden, cache = spec.hidden(params, prompt, jnp.arange(t)[None], jnp.ones_like(prompt),
                                    cache, pixels=pixels)
        out = []

        def pick(hidden):
            logp = jax.nn.log_softmax(spec.logits(params, hidden[:, -1]))
            token = jnp.argmax(logp, -1)
            out.append((token[0], logp[0, token[0]]))
            return token

        token = pick(hidden)
        for i in range(new - 1):
            hidden, cache = spec.hidden(params, token[:, None], jnp.full((1, 1), t + i),
                                        jnp.ones((1, 1), jnp.int32), cache)
            token = pick(hidden)
        return jnp.stack([o[0] for o in out]), jnp.stack([o[1] for o in out])
    tokens, logprobs = run(params, pixels[None], jnp.asarray([prompt], jnp.int32))
    return np.asarray(tokens).tolist(), np.asarray(logprobs)


@pytest.mark.slow
def test_engine_with_images_equals_the_model_and_never_shares_kv_between_images(gemma3_vlm_dir):
    """The rollout engine on prompts with images (greedy, one decode slot, blocks of 4,
    prefix cache on): two images under the same tokens, three requests each, one at a
    time, so the later ones find the earlier ones' blocks in the prefix cache and prefill
    from inside the image (its last block holds image tokens). Every completion equals the
    model's own greedy tokens for its image; keying cached blocks by tokens alone would
    hand the second image's requests the first image's keys and values (their tokens
    happen to agree; their log-probs do not)."""
    from gpurl.config import RolloutConfig
    from gpurl.rollout.engine import Engine
    from gpurl.rollout.requests import Request
    from gpurl.distributed.mesh import rollout_mesh

    model, path = gemma3_vlm_dir
    cfg, spec, params = _gpurl_vlm(path)
    # 21 tokens, the image last (no end token: its last token predicts from the image): the
    # last block starts at the image's 16th token
    prompt = [2, 11, 12, 13] + _image_block()[:-1]
    images = [gemma3_pixels(im, 64) for im in _images()[:2]]
    new = 6
    expected = [_reference_greedy(cfg, spec, params, prompt, im[None], new) for im in images]
    assert np.abs(expected[0][1] - expected[1][1]).max() > 1e-2
    rollout = RolloutConfig(max_new_tokens=new, temperature=0.0, block_size=4, decode_chunk=3,
                            slots=1, prefix_cache=True)
    engine = Engine(spec, rollout, rollout_mesh(MeshConfig(rollout_tp=1), devices=jax.devices()[:1]),
                    MeshConfig().sample_rules, stop_ids=(), pad_id=0)
    requests = [Request(tuple(prompt), new, 0.0, seed=s, images=(im,), images_key=key)
                for im, key in zip(images, ("a", "b")) for s in range(3)]
    done = engine.generate(params, requests)
    for c, (tokens, logprobs) in zip(done, [expected[0]] * 3 + [expected[1]] * 3):
        assert c.tokens.tolist() == tokens
        np.testing.assert_allclose(c.logprobs, logprobs, atol=2e-5)
    assert engine.stats["cached_tokens"] == 4 * 20  # the later requests of each image hit its cache


@pytest.mark.e2e
def test_grpo_on_images_runs_end_to_end_and_refuses_what_it_cannot_yet_do(tmp_path):
    """`gpurl train algo=grpo` on the quadrant task with the tiny vision-language model:
    rollouts read each prompt's image, the batch carries the prompts' pixels to the train
    step, held-out evaluation runs; packed rows and continuous rollouts with images are one
    sentence each."""
    import dataclasses

    from conftest import make_config
    from gpurl.train.loop import train

    cfg = make_config(model=TINY_VLM, data={"name": "quadrant", "max_len": 96, "num_train": 32,
                                            "num_eval": 8},
                      algo={"name": "grpo", "num_generations": 4}, logger={"progress": False},
                      rollout={"max_new_tokens": 16},
                      train={"steps": 2, "batch_size": 4, "eval_every": 2, "packed": False,
                             "checkpoint_every": 0},
                      run={"dir": str(tmp_path / "run")})
    summary = train(cfg)
    assert summary["finished"] and 0 <= summary["eval/accuracy"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    with pytest.raises(ConfigError, match=r"^prompts with images train on padded rows so far; "
                                          r"set train.packed=false\.$"):
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, packed=True),
                                  run=dataclasses.replace(cfg.run, dir=str(tmp_path / "packed"))))


def test_what_rl_with_images_cannot_do_yet_is_one_sentence():
    from gpurl.config import EnvConfig, RolloutConfig, TrainConfig
    from gpurl.rollout.sources import batch_source
    from gpurl.train.rl import _check_images

    prompts = _image_prompts()
    with pytest.raises(ConfigError, match=r"^prompts with images cannot be sampled in "
                                          r"rollout.mode=continuous yet .*; use rollout.mode=sync "
                                          r"or one_ahead\.$"):
        batch_source(RolloutConfig(mode="continuous"), None, _Split(), prompts, group=2,
                     batch_size=2, seed=0, steps=1)
    with pytest.raises(ConfigError, match=r"^prompts with images go through single-turn "
                                          r"rollouts only so far; drop env or the images\.$"):
        _check_images(TrainConfig(packed=False), EnvConfig(name="calculator"))
    _check_images(TrainConfig(packed=False), None)


class _Split:
    colocated = False


def _image_prompts():
    from gpurl.rollout.prompts import encode_prompts

    row = {"prompt": "<start_of_image>Which?", "answer": "a", "images": [_png()]}
    return encode_prompts([row], _tokenizer(), False, 64, "train")[0]