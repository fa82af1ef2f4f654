import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pixel_model(tmp_path_factory) -> str:
    """A tiny random-init mmrl pixel model folder (real SD3Transformer2DModel + CLIP text encoder)."""
    from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
    from tasks import shapes

    torch.manual_seed(0)
    words = sorted({w for p in shapes.all_prompts() for w in p.text.split()})
    path = str(tmp_path_factory.mktemp("models") / "tiny-pixel")
    save_pipeline_parts(build_pipeline_parts(words, "tiny", 24), path)
    return path
