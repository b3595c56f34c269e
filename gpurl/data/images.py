"""Images of vision-language rows (issue 67, first part): read from a path, bytes or the
`datasets` Image feature's dict, checked, and preprocessed as the model's own processor
does, so the pixels the tower sees are the ones transformers' processor gives.

Gemma 3 (HF `Gemma3ImageProcessor`): RGB (transparent pixels over white, as transformers'
`convert_to_rgb`), resized to the tower's square size with Pillow's bilinear filter (the aspect ratio is not kept), scaled to [0, 1], then normalized with mean
0.5 and standard deviation 0.5 per channel: C x S x S floats in [-1, 1].
"""

from __future__ import annotations

import io
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
