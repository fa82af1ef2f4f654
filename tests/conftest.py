import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # train.threads=auto follows it: runs the tests compare use one thread
torch.set_num_threads(1)

# The fast tier, `pytest -m unit` (seconds): the pure tests of formulas, configs, layering and docs, which build at
# most a tiny model. They stay in the default run too. A module listed here that no longer exists stops the run,
# so a rename cannot drop it from the tier silently; add a module only if it runs in a few seconds on 2 cores.
UNIT_MODULES = ("test_algorithms.py", "test_objective.py", "test_token_algorithms.py", "test_dgpo.py", "test_dpo.py",
                "test_awm_anchored.py", "test_flow_dppo.py", "test_flow_sde.py", "test_config.py", "test_layering.py",
                "test_docs.py")


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    missing = [m for m in UNIT_MODULES if not os.path.exists(os.path.join(ROOT, "tests", m))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py UNIT_MODULES names {missing}, which do not exist: fix the list")
    for item in items:
        if os.path.basename(str(item.path)) in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)


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


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> str:
    """A small embedded grounding world (real mp4 files, Charades-STA annotations)."""
    from tasks.grounding_world import build_world

    root = str(tmp_path_factory.mktemp("world") / "grounding")
    build_world(root, {"train": 6, "test": 3})
    return root


def build_tiny_vl(path: str, kind: str = "qwen2_5_vl", size: str = "tiny") -> str:
    """Save a tiny (or small) random-init Qwen-VL of `kind` (real class, local tokenizer and processor) at path."""
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from tasks.grounding_world import ANSWER, PROMPT

    torch.manual_seed(0)
    tok = build_tokenizer([PROMPT, ANSWER, "red green blue yellow circle square triangle appears shown visible"])
    build_model(kind, tok, size).save_pretrained(path)
    build_processor(kind, tok).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory) -> str:
    return build_tiny_vl(str(tmp_path_factory.mktemp("models") / "tiny-qwen2_5_vl"))


@pytest.fixture(scope="session")
def tiny_motion_model(tmp_path_factory) -> str:
    """A tiny random-init mmrl pixel VIDEO model folder (real WanTransformer3DModel + CLIP text encoder)."""
    from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
    from tasks import motion

    torch.manual_seed(0)
    words = sorted({w for p in motion.all_prompts() for w in p.text.split()})
    path = str(tmp_path_factory.mktemp("models") / "tiny-motion")
    save_pipeline_parts(build_pipeline_parts(words, "tiny", 16, patch_size=4, frames=motion.FRAMES), path)
    return path


@pytest.fixture(scope="session")
def tiny_arithmetic_lm(tmp_path_factory) -> str:
    """A tiny random-init causal LM (real Qwen2 class) with a tokenizer fitted to the arithmetic task's prompts."""
    from mmrl.models.qwen_vl import build_causal_lm, build_tokenizer
    from tasks import arithmetic

    torch.manual_seed(0)
    tok = build_tokenizer([p["prompt"] for p in arithmetic.problems("train", 10, 20)])
    path = str(tmp_path_factory.mktemp("models") / "tiny-lm")
    build_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path
