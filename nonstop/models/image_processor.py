"""Images to model input: load, convert to RGB, resize, rescale and normalise (host side, PIL).

`ImageProcessor` follows a checkpoint's `preprocessor_config.json` (transformers' Gemma 3 image
processor fields): resize to `size` with the given PIL resample filter, multiply by
`rescale_factor`, subtract `image_mean` and divide by `image_std`, giving float32[H, W, 3]
(channels last, the layout `VisionEncoder` takes). Pan-and-scan crops are not implemented and a
config that enables them is refused.

Bad input is an `ImageError` that names the image (and, from the data pipeline, the example): a
missing or unreadable file, or an image mode we do not convert (we take RGB, RGBA, L, LA, P and
CMYK; transparency is composited onto white, as transformers' `convert_to_rgb` does).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

SUPPORTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "CMYK")


class ImageError(ValueError):
    """An image is missing, unreadable or in a mode we do not convert."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """Resize / rescale / normalise settings (transformers' image-processor field names)."""

    height: int = 896
    width: int = 896
    resample: int = 2  # PIL.Image.Resampling.BILINEAR, transformers' default for Gemma 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ValueError(f"image size must be positive, got {self.height}x{self.width}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean and image_std need 3 values (std > 0), got "
                             f"{self.image_mean}, {self.image_std}")

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ImageProcessor:
        """Read `preprocessor_config.json` from a checkpoint directory."""
        path = Path(directory)
        path = path / "preprocessor_config.json" if path.is_dir() else path
        if not path.exists():
            raise ImageError(f"{path}: no preprocessor_config.json found")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "<dict>") -> ImageProcessor:
        if d.get("do_pan_and_scan"):
            raise ImageError(f"{source}: do_pan_and_scan is not supported; set it to false")
        size = d.get("size") or {}
        side = size.get("shortest_edge")
        return cls(height=int(size.get("height", side or 896)),
                   width=int(size.get("width", side or 896)),
                   resample=int(d.get("resample", 2)), do_resize=bool(d.get("do_resize", True)),
                   do_rescale=bool(d.get("do_rescale", True)),
                   rescale_factor=float(d.get("rescale_factor", 1 / 255)),
                   do_normalize=bool(d.get("do_normalize", True)),
                   image_mean=tuple(d.get("image_mean", (0.5, 0.5, 0.5))),
                   image_std=tuple(d.get("image_std", (0.5, 0.5, 0.5))))

    def to_dict(self) -> dict[str, Any]:
        return {"image_processor_type": "Gemma3ImageProcessor", "do_resize": self.do_resize,
                "size": {"height": self.height, "width": self.width},
                "resample": self.resample, "do_rescale": self.do_rescale,
                "rescale_factor": self.rescale_factor, "do_normalize": self.do_normalize,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "do_convert_rgb": True, "do_pan_and_scan": False}

    def __call__(self, image: Image.Image | str | Path, *, where: str = "") -> np.ndarray:
        """One image (PIL or a file path) -> float32[H, W, 3]."""
        image = load_image(image, where=where) if isinstance(image, (str, Path)) else image
        label = f"{where}: " if where else ""
        if image.mode not in SUPPORTED_MODES:
            raise ImageError(f"{label}image mode {image.mode!r} is not supported; convert the "
                             f"image to one of {SUPPORTED_MODES} (e.g. RGB)")
        rgb = to_rgb(image)
        if self.do_resize and rgb.size != (self.width, self.height):
            rgb = rgb.resize((self.width, self.height), resample=Image.Resampling(self.resample))
        x = np.asarray(rgb, np.float32)
        if self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std,
                                                                          np.float32)
        return x.astype(np.float32)

    def batch(self, images: list[Image.Image | str | Path], *, where: str = "") -> np.ndarray:
        """Several images -> float32[I, H, W, 3]."""
        return np.stack([self(im, where=where) for im in images]) if images else np.zeros(
            (0, self.height, self.width, 3), np.float32)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(path: str | Path, *, where: str = "") -> Image.Image:
    """Open an image file fully (so a truncated file fails here, not later)."""
    label = f"{where}: " if where else ""
    path = Path(path)
    if not path.exists():
        raise ImageError(f"{label}image file {str(path)!r} does not exist")
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ImageError(f"{label}image file {str(path)!r} could not be read as an image: "
                         f"{e}") from None


__all__ = ["SUPPORTED_MODES", "ImageError", "ImageProcessor", "load_image", "to_rgb"]
