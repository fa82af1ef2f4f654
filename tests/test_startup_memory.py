"""Memory that scales as 1/world from the first byte: under FSDP2 the trained transformer is built on the meta device,
each rank reads only its shards from the safetensors files, the frozen KL reference is copied shard by shard in the
checkpoint's dtype, and the EMA shadow is a set of fp32 shards; one process and DDP keep their behaviour."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/startup_shards.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_meta_component_loads_what_from_pretrained_loads(tiny_pixel_model, dtype):
    """Same names, dtypes and values as diffusers' from_pretrained (SD3's positional table is a buffer the
    constructor computes: it stays real on the meta model)."""
    from diffusers import SD3Transformer2DModel

    from mmrl.models.shard_load import load_into_shards, meta_component

    ref = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_pixel_model, "transformer"), dtype=dtype)
    m = meta_component(tiny_pixel_model, "transformer", dtype)
    assert all(p.is_meta for p in m.parameters()) and not any(b.is_meta for b in m.buffers())
    load_into_shards(m, os.path.join(tiny_pixel_model, "transformer"), torch.device("cpu"))
    got, want = m.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_a_meta_component_keeps_the_modules_its_class_keeps_in_fp32(tmp_path):
    """Wan keeps scale_shift_table (and norms) in fp32 under a bf16 load; the meta build does the same."""
    from diffusers import WanTransformer3DModel

    from mmrl.models.families.wan import tiny_transformer
    from mmrl.models.shard_load import load_into_shards, meta_component

    torch.manual_seed(0)
    tiny_transformer().save_pretrained(tmp_path / "transformer")
    ref = WanTransformer3DModel.from_pretrained(tmp_path / "transformer", dtype=torch.bfloat16)
    m = meta_component(str(tmp_path), "transformer", torch.bfloat16)
    load_into_shards(m, str(tmp_path / "transformer"), torch.device("cpu"))
    got, want = m.state_dict(), ref.state_dict()
    assert {v.dtype for v in want.values()} == {torch.float32, torch.bfloat16}
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_weight_files_that_do_not_match_the_config_are_refused(tiny_pixel_model, tmp_path):
    from safetensors.torch import save_file

    from mmrl.models.shard_load import load_into_shards, meta_component

    sd = load_file(os.path.join(tiny_pixel_model, "transformer", "diffusion_pytorch_model.safetensors"))
    sd.pop("proj_out.weight")
    os.makedirs(tmp_path / "transformer")
    save_file(sd, tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['proj_out.weight'\]"):
        load_into_shards(meta_component(tiny_pixel_model, "transformer", torch.float32), str(tmp_path / "transformer"),
                         torch.device("cpu"))


def test_the_kl_reference_keeps_the_checkpoints_dtype(tiny_pixel_model, tmp_path):
    """One process, model.dtype=bfloat16, full fine-tuning with KL: trained weights fp32 (master weights), the
    frozen reference bf16 (half the memory of the fp32 copy it was), equal to the live weights' values."""
    from mmrl.compose import build_policy, load_config

    cfg = load_config("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}",
                                                       "model.dtype=bfloat16", "train.mixed_precision=bf16",
                                                       "model.reference=auto", "algo.kl_coef=0.1"])
    policy = build_policy(cfg)
    live, ref = policy.model.transformer, policy._ref_copy["transformer"]
    assert {p.dtype for p in live.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a.to(b.dtype), b) for a, b in zip(live.parameters(), ref.parameters()))


# ~45 s each on 2 quiet cores; the fp32 run's equality with one process is also in test_distributed.py's ema_kl
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_fsdp_builds_on_meta_and_loads_into_shards(tiny_pixel_model, tmp_path, dtype):
    """2 processes under FSDP2, full fine-tuning with KL and EMA: before sharding the live transformer and the
    reference hold no storage (meta); after, each rank holds half of every parameter: live and EMA in fp32, the
    reference in model.dtype, all equal to the weight file. In fp32 one iteration ends where one process ends."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run([*launch, WORKER, tiny_pixel_model, str(tmp_path / "two.safetensors"), "--dtype", dtype],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {rank: json.load(open(f"{tmp_path / 'two.safetensors'}.rank{rank}.json")) for rank in (0, 1)}
    ref_dtype = "torch.bfloat16" if dtype == "bfloat16" else "torch.float32"
    for rank in (0, 1):
        rep = got[rank]
        assert rep["meta_before_shard"] and rep["ref_meta_before_shard"], rep
        assert rep["live_sharded"] and rep["ref_sharded"] and rep["ema_sharded"], rep
        assert rep["live_dtypes"] == ["torch.float32"] and rep["ema_dtypes"] == ["torch.float32"], rep
        assert rep["ref_dtypes"] == [ref_dtype], rep
        assert 0.45 < rep["local_fraction"] < 0.55, rep
        assert rep["live_equals_disk"] and rep["ref_equals_disk"] and rep["ema_equals_live"], rep
    if dtype == "float32":
        r = subprocess.run([sys.executable, WORKER, tiny_pixel_model, str(tmp_path / "one.safetensors")], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        one, two = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
        diff = max((one[k] - two[k]).abs().max().item() for k in one)
        assert diff < 1e-6, f"FSDP loaded into shards differs from one process by {diff} after one iteration"


def test_lora_under_fsdp_reads_its_base_into_shards(tiny_pixel_model, tmp_path):
    """LoRA (KL to the base through the disabled adapters, EMA) on 2 FSDP2 processes: the frozen base is meta before
    sharding and each rank then holds half of it, equal to the weight file; the adapters start in their shards where
    one process starts them (init_adapters); one iteration ends where one process ends."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {"two": [*launch, WORKER], "one": [sys.executable, WORKER]}
    for name, cmd in runs.items():
        r = subprocess.run([*cmd, tiny_pixel_model, str(tmp_path / f"{name}.safetensors"), "--lora"], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        rep = json.load(open(f"{tmp_path / 'two.safetensors'}.rank{rank}.json"))
        assert rep["meta_before_shard"] and rep["live_sharded"] and rep["live_equals_disk"], rep
        assert 0.45 < rep["local_fraction"] < 0.55, rep
        assert rep["adapters"] > 0 and rep["adapters_equal_one_process"], rep
    one, two = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert set(one) == set(two) and len(one) > 0
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert diff < 1e-6, f"LoRA loaded into shards differs from one process by {diff} after one iteration"


def test_sharded_weight_files_load_through_their_index(tiny_pixel_model, tmp_path):
    """A folder saved in several safetensors files (the hub's large models) beside an fp16 variant: the index's
    files are read, the variant is not."""
    from diffusers import SD3Transformer2DModel

    from mmrl.models.shard_load import load_into_shards, meta_component, weight_files

    ref = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_pixel_model, "transformer"))
    ref.save_pretrained(tmp_path / "transformer", max_shard_size="20KB")
    ref.half().save_pretrained(tmp_path / "half", variant="fp16")
    for f in os.listdir(tmp_path / "half"):
        if f.endswith(".safetensors"):
            os.replace(tmp_path / "half" / f, tmp_path / "transformer" / f)
    assert os.path.isfile(tmp_path / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    files = weight_files(str(tmp_path / "transformer"))
    assert len(files) > 1 and not any("fp16" in f for f in files)
    ref = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_pixel_model, "transformer"))
    m = meta_component(tiny_pixel_model, "transformer", torch.float32)
    load_into_shards(m, str(tmp_path / "transformer"), torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
