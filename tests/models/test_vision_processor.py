"""The image processor against transformers' Gemma 3 (PIL) image processor, and bad images."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from nonstop.models.image_processor import ImageError, ImageProcessor

ATOL = 1e-6


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_matches_transformers_image_processor(mode, tmp_path):
    pixels = np.random.RandomState(0).randint(0, 256, (45, 61, 4), np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode)
    ref = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.4, 0.5, 0.6],
                                  image_std=[0.2, 0.3, 0.25])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(ref.to_dict(), default=int))
    ours = ImageProcessor.from_pretrained(tmp_path)
    assert (ours.height, ours.width, ours.image_mean) == (28, 28, (0.4, 0.5, 0.6))
    expected = ref(images=[image], return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    np.testing.assert_allclose(ours(image), expected, atol=ATOL, rtol=0)


def test_file_errors_name_the_image_and_the_example(tmp_path):
    processor = ImageProcessor(height=28, width=28)
    with pytest.raises(ImageError, match=r"ex 3: image file '.*nope.png' does not exist"):
        processor(tmp_path / "nope.png", where="ex 3")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ImageError, match=r"ex 4: image file '.*bad.png' could not be read"):
        processor(tmp_path / "bad.png", where="ex 4")
    with pytest.raises(ImageError, match=r"image mode 'F' is not supported"):
        processor(Image.new("F", (5, 5)))


def test_pan_and_scan_is_refused():
    with pytest.raises(ImageError, match="do_pan_and_scan"):
        ImageProcessor.from_dict({"do_pan_and_scan": True})


def test_rescale_and_normalise_by_hand():
    image = Image.new("RGB", (28, 28), (255, 0, 51))
    out = ImageProcessor(height=28, width=28)(image)
    np.testing.assert_allclose(out[0, 0], [1.0, -1.0, -0.6], atol=1e-6)
