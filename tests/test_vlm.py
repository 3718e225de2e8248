"""VLM splicing: each image's tokens replace its sentinel, text rows stay the token embeddings."""

import pytest
import torch

from tinyvila.config import preset
from tinyvila.loader import random_state_dict
from tinyvila.tokenizer import IMAGE_TOKEN
from tinyvila.vlm import VLM


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-siglip-llama")
    m = VLM(cfg)
    m.load_state_dict(random_state_dict(cfg, seed=0), assign=True)
    return m.eval()


def test_images_are_spliced_at_their_sentinels(model):
    n = model.cfg.image_tokens
    d = model.cfg.text.dim
    images = torch.randn(2, n, d)
    ids = [5, 6, IMAGE_TOKEN, 7, IMAGE_TOKEN, 8, 9]
    h = model.embed(ids, images)[0]
    assert h.shape == (7 - 2 + 2 * n, d) and model.n_embeds(ids) == h.shape[0]
    table = model.text.embed.weight
    torch.testing.assert_close(h[:2], table[[5, 6]], rtol=0, atol=0)
    torch.testing.assert_close(h[2:2 + n], images[0], rtol=0, atol=0)
    torch.testing.assert_close(h[2 + n], table[7], rtol=0, atol=0)
    torch.testing.assert_close(h[3 + n:3 + 2 * n], images[1], rtol=0, atol=0)
    torch.testing.assert_close(h[-2:], table[[8, 9]], rtol=0, atol=0)


def test_image_count_must_match_the_placeholders(model):
    images = torch.randn(1, model.cfg.image_tokens, model.cfg.text.dim)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        model.embed([IMAGE_TOKEN, 1, IMAGE_TOKEN], images)
    with pytest.raises(ValueError, match="0 image placeholders but 1"):
        model.embed([1, 2], images)


def test_encode_images_gives_llm_width_tokens(model):
    s = model.cfg.vision.image_size
    pixels = torch.randn(3, 3, s, s)
    out = model.encode_images(pixels)
    assert out.shape == (3, model.cfg.image_tokens, model.cfg.text.dim)
    # each image is encoded independently of the others in the batch
    torch.testing.assert_close(out[1:2], model.encode_images(pixels[1:2]), rtol=1e-5, atol=1e-5)
