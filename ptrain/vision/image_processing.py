"""Images -> patches, as transformers' Qwen2-VL image processor makes them.

Each image is converted to RGB (transparency composited onto white, as transformers does),
resized with PIL's bicubic filter to a size whose sides are multiples of 28 (patch 14 x merge
2) with its pixel count within [min_pixels, max_pixels] (`smart_resize`), scaled to [0, 1],
normalised with the CLIP mean and std, and cut into 14x14 patches, each repeated over the
temporal patch of 2 and flattened (channel, time, row, column) in 2x2 merge-group order.
The result equals transformers' `Qwen2VLImageProcessorPil` (its PIL backend) to float32
rounding; the torchvision backend resizes with torch's antialiased bicubic instead, which
differs in the last uint8 level of some pixels.

Accepted: PIL images of any mode (L, LA, P, RGBA, CMYK, I;16 ... are converted by PIL's
`convert("RGB")`), uint8 arrays [h, w], [h, w, 1|3|4]; a path is opened with PIL. A file
that is not an image, or is truncated, raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageProcessing:
    """preprocessor_config.json's settings (Qwen2-VL's defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"ImageProcessing: need 0 < min_pixels ({self.min_pixels}) <= "
                             f"max_pixels ({self.max_pixels})")

    @classmethod
    def from_hf(cls, d: dict) -> ImageProcessing:
        """From a preprocessor_config.json dict (`size` {shortest_edge, longest_edge} or the
        older min_pixels / max_pixels)."""
        size = d.get("size") or {}
        return cls(
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            mean=tuple(d.get("image_mean", CLIP_MEAN)), std=tuple(d.get("image_std", CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)))

    def to_hf(self) -> dict:
        return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
                "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "resample": 3, "rescale_factor": self.rescale_factor,
                "image_mean": list(self.mean), "image_std": list(self.std),
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size}


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The size an image is resized to: sides multiples of `factor`, pixels within
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    if min(height, width) < 1:
        raise ValueError(f"image of {height}x{width} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {height}x{width} pixels: the aspect ratio must be below 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """A PIL RGB image from a PIL image, a uint8 array, a file path or an encoded file's
    bytes (PNG, JPEG, ...: a tool's render)."""
    from PIL import Image
    if isinstance(image, (str, os.PathLike, bytes, bytearray)):
        what = (f"{len(image)} bytes" if isinstance(image, (bytes, bytearray))
                else repr(os.fspath(image)))
        try:
            source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
            with Image.open(source) as opened:
                opened.load()
                image = opened.copy()
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{what} is not a readable image ({e}); pass a PNG, "
                             "JPEG or another format PIL opens") from e
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8 [h, w] or [h, w, 1|3|4], got "
                             f"{image.dtype} {image.shape}")
        if image.ndim == 3 and image.shape[-1] == 1:
            image = image[..., 0]
        if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (3, 4))):
            raise ValueError(f"image arrays must be [h, w] or [h, w, 1|3|4], got {image.shape}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image, a uint8 array, a path or bytes, got "
                        f"{type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def patchify(pixels_chw: np.ndarray, p: ImageProcessing) -> tuple[np.ndarray, tuple[int, ...]]:
    """Normalised [c, h, w] -> (patches [t*h*w, c*tp*ps*ps], grid (1, h / ps, w / ps))."""
    c, height, width = pixels_chw.shape
    ps, m, tp = p.patch_size, p.merge_size, p.temporal_patch_size
    gh, gw = height // ps, width // ps
    x = pixels_chw.reshape(c, gh // m, m, ps, gw // m, m, ps)
    x = np.transpose(x, (1, 4, 2, 5, 0, 3, 6))  # [gh/m, gw/m, m, m, c, ps, ps]
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (tp,) + x.shape[5:])
    return x.reshape(gh * gw, c * tp * ps * ps), (1, gh, gw)


def preprocess(images, p: ImageProcessing = ImageProcessing()):
    """(patches float32 [total patches, patch_dim], grids int64 [images, 3]) for a list of
    images (one image alone is accepted too)."""
    from PIL import Image
    if not isinstance(images, (list, tuple)):
        images = [images]
    factor = p.patch_size * p.merge_size
    patches, grids = [], []
    mean = np.asarray(p.mean, np.float32)
    std = np.asarray(p.std, np.float32)
    for image in images:
        rgb = to_rgb(image)
        h, w = smart_resize(rgb.height, rgb.width, factor, p.min_pixels, p.max_pixels)
        resized = np.asarray(rgb.resize((w, h), resample=Image.Resampling.BICUBIC))
        x = (resized.astype(np.float64) * p.rescale_factor).astype(np.float32)
        x = ((x - mean) / std).transpose(2, 0, 1)
        flat, grid = patchify(x, p)
        patches.append(flat)
        grids.append(grid)
    return (np.concatenate(patches).astype(np.float32) if patches
            else np.zeros((0, 3 * p.temporal_patch_size * p.patch_size ** 2), np.float32),
            np.asarray(grids, np.int64).reshape(-1, 3))
