"""Vision-language models, first part (issue 67): Gemma 3's SigLIP tower and projector
(`gpurl.models.vision`) against transformers' `Gemma3ForConditionalGeneration` image
features, and the image preprocessing (`gpurl.data.images`) against transformers'
`Gemma3ImageProcessorPil` on the same images; bad images in one sentence each."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from gpurl.config import ConfigError
from gpurl.data.images import gemma3_pixels, open_image, qwen_pixels
from gpurl.models.vision import VisionSpec, image_features, init_params, load_hf

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
