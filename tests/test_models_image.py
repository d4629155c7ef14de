"""`preprocess_image` against Hugging Face's CLIP and SigLIP image processors (PIL backend,
run in the peer env's python when present), plus its own size rules and bad input."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from models_util import HF_PYTHON
from PIL import Image

from jaxkv.models import preprocess_image
from jaxkv.models.image import resized_size

CLIP = {
    "do_resize": True, "size": {"shortest_edge": 16}, "resample": 3,
    "do_center_crop": True, "crop_size": {"height": 16, "width": 16},
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
}  # fmt: skip
SIGLIP = {
    "do_resize": True, "size": {"height": 16, "width": 16}, "resample": 3,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
# Both processors in one run of the peer python: its transformers import is most of the
# cost (about 10 s of CPU), the processing itself is instant.
HF_SNIPPET = """
import json, sys, numpy as np
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
classes = {"clip": CLIPImageProcessorPil, "siglip": SiglipImageProcessorPil}
image = Image.open(sys.argv[2])
np.savez(sys.argv[3], **{
    kind: np.asarray(classes[kind](**config)(images=image, return_tensors="np")["pixel_values"][0],
                     np.float32)
    for kind, config in json.loads(sys.argv[1]).items()
})
"""


@pytest.fixture
def image(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (37, 23, 3), dtype=np.uint8)
    path = tmp_path / "image.png"
    Image.fromarray(rgb).save(path)
    return path


@pytest.mark.skipif(not HF_PYTHON.exists(), reason="no .venv-vllm with transformers")
def test_matches_transformers_image_processors(tmp_path, image):
    configs = {"clip": CLIP, "siglip": SIGLIP}
    out = tmp_path / "hf.npz"
    subprocess.run(
        [str(HF_PYTHON), "-c", HF_SNIPPET, json.dumps(configs), str(image), str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    theirs = np.load(out)
    for kind, config in configs.items():
        ours = preprocess_image(Image.open(image), config)
        assert ours.shape == (3, 16, 16) and ours.dtype == np.float32
        np.testing.assert_allclose(ours, theirs[kind], atol=1e-5, err_msg=kind)


def test_sizes_and_steps(image):
    assert resized_size(37, 23, {"shortest_edge": 16}) == (25, 16)
    assert resized_size(23, 37, {"shortest_edge": 16}) == (16, 25)
    assert resized_size(37, 23, {"height": 8, "width": 12}) == (8, 12)
    raw = preprocess_image(
        Image.open(image), {"do_resize": False, "do_rescale": False, "do_normalize": False}
    )
    np.testing.assert_array_equal(raw, np.asarray(Image.open(image)).transpose(2, 0, 1))
    gray = Image.fromarray(np.full((20, 20), 255, np.uint8))
    assert preprocess_image(gray, SIGLIP).shape == (3, 16, 16)  # converted to RGB
    np.testing.assert_allclose(preprocess_image(gray, SIGLIP), 1.0, atol=1e-6)


def test_bad_input(image):
    with pytest.raises(TypeError, match="image must be a PIL.Image.Image, got ndarray"):
        preprocess_image(np.zeros((4, 4, 3)), CLIP)
    with pytest.raises(ValueError, match="preprocessor_config size="):
        preprocess_image(Image.open(image), {**CLIP, "size": {"longest": 3}})
