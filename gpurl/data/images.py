"""Images of vision-language rows (issue 67, first part): read from a path, bytes or the
`datasets` Image feature's dict, checked, and preprocessed as the model's own processor
does, so the pixels the tower sees are the ones transformers' processor gives.

Gemma 3 (HF `Gemma3ImageProcessor`): RGB (transparent pixels over white, as transformers'
`convert_to_rgb`), resized to the tower's square size with Pillow's bilinear filter (the aspect ratio is not kept), scaled to [0, 1], then normalized with mean
0.5 and standard deviation 0.5 per channel: C x S x S floats in [-1, 1].
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from gpurl.config import ConfigError

# Pixels an image may hold before it is decoded (Pillow's own bomb guard is a warning below
# twice this); a larger one is refused in one sentence.
MAX_PIXELS = 178_956_970


def open_image(source: Any, where: str = "an image") -> Image.Image:
    """The decoded image of `source`: a path, bytes, a dict with "bytes" or "path" (the
    `datasets` Image feature), or a Pillow image; one sentence naming `where` when it
    cannot be read."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        data = source.get("bytes") or source.get("path")
        if data is None:
            raise ConfigError(f"{where} is a dict without \"bytes\" or \"path\"; give the "
                              f"image's file path or its bytes.")
        source = data
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{where}: {path} does not exist; fix the path (relative "
                              f"paths are read from the working directory).")
        source = path.read_bytes()
    if not isinstance(source, (bytes, bytearray)) or not source:
        raise ConfigError(f"{where} is empty or not an image (a path, bytes or an "
                          f"Image feature); give the image's file path or its bytes.")
    try:
        with Image.open(io.BytesIO(source)) as image:
            width, height = image.size
            if width < 1 or height < 1 or width * height > MAX_PIXELS:
                raise Image.DecompressionBombError(f"{width} x {height}")
            image.load()
            return image.copy()
    except Image.DecompressionBombError:  # Pillow's guard, or ours: from the header alone
        raise ConfigError(f"{where} has more than {MAX_PIXELS:,} pixels (or none); resize "
                          f"it before training.") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"{where} could not be decoded ({type(e).__name__}); give a "
                          f"complete PNG, JPEG, GIF or WebP file.") from None


def image_key(source: Any) -> Any:
    """A hashable stand-in for an image source: a path as itself, bytes (or the datasets
    Image feature's) by their SHA-256."""
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return hashlib.sha256(source).hexdigest()
    return source if isinstance(source, str) else repr(source)


def rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, any transparency laid over a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def gemma3_pixels(image: Image.Image, size: int) -> np.ndarray:
    """3 x `size` x `size` float32: `Gemma3ImageProcessor`'s pixel values of one image."""
    rgb_image = rgb(image).resize((size, size), Image.Resampling.BILINEAR)
    x = np.asarray(rgb_image, np.float32) / 255.0
    return ((x - 0.5) / 0.5).transpose(2, 0, 1)


# Qwen2-VL / Qwen2.5-VL (HF `Qwen2VLImageProcessor`, Wang et al. 2024, sec. 2.1: "naive
# dynamic resolution"): the image keeps its aspect ratio, resized so that both sides are
# multiples of patch x merge pixels and its area lies within a pixel budget, with Pillow's
# bicubic filter, scaled to [0, 1] and normalized with OpenAI CLIP's mean and deviation.
CLIP_MEAN = np.asarray([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.asarray([0.26862954, 0.26130258, 0.27577711], np.float32)


def qwen_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
              where: str = "an image") -> tuple[int, int]:
    """(height, width) the image is resized to: sides rounded to multiples of `factor`,
    scaled down into `max_pixels` or up to `min_pixels` with the aspect ratio kept."""
    if max(height, width) > 200 * min(height, width):
        raise ConfigError(f"{where} is {width} x {height} pixels, more than 200 times as wide "
                          f"as high (or high as wide); crop it before training.")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class QwenPixels:
    """One image for a Qwen VL tower: its patches and their grid."""

    patches: np.ndarray  # (grid_h * grid_w) x (C * temporal * patch * patch), merge windows together
    grid: tuple[int, int, int]  # (frames, grid_h, grid_w) in patches (`image_grid_thw`)
    merge: int  # patches merged into one image token per side

    @property
    def tokens(self) -> int:
        """Image tokens the language model sees: the patch grid merged merge x merge."""
        return self.grid[0] * self.grid[1] * self.grid[2] // (self.merge * self.merge)


def qwen_pixels(image: Image.Image, patch: int = 14, merge: int = 2, temporal: int = 2,
                min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280,
                where: str = "an image") -> QwenPixels:
    """`Qwen2VLImageProcessor`'s pixel values and grid of one image: resized within the
    pixel budget (`qwen_size`), cut into patch x patch squares ordered merge window by
    merge window (the windows row by row, the patches of a window row by row), each patch's
    pixels as (channel, frame, row, column), a still image repeated over `temporal` frames."""
    width, height = image.size
    h, w = qwen_size(height, width, patch * merge, min_pixels, max_pixels, where)
    resized = rgb(image).resize((w, h), Image.Resampling.BICUBIC)
    x = (np.asarray(resized, np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD  # H x W x C
    c, gh, gw = x.shape[2], h // patch, w // patch
    x = x.transpose(2, 0, 1).reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # windows, patches of a window, channel, pixels
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return QwenPixels(np.ascontiguousarray(x).reshape(gh * gw, c * temporal * patch * patch),
                      (1, gh, gw), merge)
