"""train.compile (mmrl/compiled.py): the repeated blocks are found for every kind of model, compiled in place (module
names and checkpoint keys unchanged), wired through the trainer after LoRA and wrapping, and equal to eager with
inductor on a tiny flow policy and a tiny token policy (velocity / logits, sampled outputs, one training step's
gradients)."""

import pytest
import torch

from mmrl.compiled import compile_blocks, repeated_blocks
from mmrl.compose import load_config
from mmrl.errors import ConfigError
from mmrl.policy import POLICIES

EXAMPLES = [{"prompt": "a red circle"}, {"prompt": "two squares"}]


def flow_policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "sampler.num_steps=4", "sampler.cfg_scale=2.0",
                                               *items]))


def names(blocks):
    return sorted({type(b).__name__ for b in blocks})


def test_repeated_blocks_of_each_kind(tmp_path):
    """diffusers' declared `_repeated_blocks` (FLUX: both block classes), else the block lists (SD3, whose class
    declares none here; a transformers decoder's layers, through peft); FSDP2's renamed classes are seen through."""
    from peft import LoraConfig, get_peft_model

    from mmrl.models.qwen_vl import build_causal_lm, build_tokenizer
    from mmrl.models.tiny_pipelines import build_tiny

    flux = build_tiny("flux").transformer
    assert flux._repeated_blocks and names(repeated_blocks(flux)) == sorted(flux._repeated_blocks)
    assert len(repeated_blocks(flux)) == len(flux.transformer_blocks) + len(flux.single_transformer_blocks)
    sd3 = build_tiny("sd3").transformer
    assert not getattr(sd3, "_repeated_blocks", None)
    assert repeated_blocks(sd3) == list(sd3.transformer_blocks)
    lm = build_causal_lm(build_tokenizer(["a b c"]))
    peft_lm = get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj"]))
    found = repeated_blocks(peft_lm)
    assert names(found) == ["Qwen2DecoderLayer"] and len(found) == len(lm.model.layers)
    block = flux.single_transformer_blocks[0]  # fully_shard swaps a unit's class for an FSDP<Block> subclass
    block.__class__ = type("FSDP" + type(block).__name__, (type(block),), {})
    assert block in repeated_blocks(flux)


def test_compiled_in_place_keeps_names_and_values(tiny_pixel_model):
    """Each block's call is compiled in place: the same modules, parameter names and state-dict keys (checkpoints,
    peft adapters, FSDP units), the same values (backend eager: the tracing alone, in seconds)."""
    pol = flow_policy(tiny_pixel_model, "model.lora.enabled=true", "model.lora.rank=4")
    tr = pol.transformer
    keys, modules = list(tr.state_dict()), list(tr.modules())
    ro = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(0))
    blocks = compile_blocks(pol.trainable_modules(), pol.device, backend="eager")
    assert blocks == list(tr.transformer_blocks) and all(b._compiled_call_impl is not None for b in blocks)
    assert list(tr.state_dict()) == keys and list(tr.modules()) == modules
    again = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(0))
    assert torch.equal(again.outputs, ro.outputs) and torch.equal(again.old_log_prob, ro.old_log_prob)


def test_trainer_compiles_after_wrapping(tiny_pixel_model, tmp_path, monkeypatch):
    """train.compile=true: the trainer compiles the trained transformer's blocks once the policy is built (LoRA
    added), and a run trains through them."""
    import mmrl.compiled
    from mmrl.trainer import Trainer

    calls = []

    def eager_backend(modules, device):
        calls.append([type(m).__name__ for m in modules])
        return compile_blocks(modules, device, backend="eager")

    monkeypatch.setattr(mmrl.compiled, "compile_blocks", eager_backend)
    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false", "train.iterations=1",
        "train.compile=true", "model.lora.enabled=true", "model.lora.rank=4", "log.eval_at_start=false",
        "task.eval_prompts=2"])
    tr = Trainer(cfg)
    assert calls == [["SD3Transformer2DModel"]] and all(b._compiled_call_impl is not None
                                                        for b in tr.policy.transformer.transformer_blocks)
    assert tr.fit()["iterations"] == 1


def test_compile_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="train.compile with train.context_parallel > 1"):
        load_config(None, ["train.compile=true", "train.context_parallel=2"])
    assert load_config(None, ["train.compile=true"]).train.compile
    import mmrl.compiled

    monkeypatch.setattr(mmrl.compiled.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        compile_blocks([torch.nn.Module()], torch.device("cpu"))
    with pytest.raises(ConfigError, match="no repeated transformer blocks"):
        compile_blocks([torch.nn.Linear(2, 2)], torch.device("cpu"), backend="eager")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _step(pol, ro, n):
    """One training step's log-probs [n, A] and gradients of sum(log-probs) (the trained parameters, by name)."""
    module = pol.trainable_modules()[0]
    module.zero_grad()
    lp = pol.log_prob(ro, torch.arange(n)).log_prob
    (lp * ro.action_mask[:n]).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


@pytest.mark.slow  # inductor compiles C++ for each graph: ~2 min (flow) and ~5 min (token) on a loaded 2-core machine
@pytest.mark.parametrize("kind", ["flow", "token"])
def test_compiled_equals_eager_with_inductor(kind, tiny_pixel_model, tmp_path):
    """The same policy, eager then compiled (inductor, the default backend): sampled outputs and old log-probs, the
    model's velocity (flow, CFG-guided) or logits (token), and one training step's log-probs and gradients agree to
    fp32 rounding (measured: <= 1e-6 absolute; the bound is 1e-4 of the gradients' scale)."""
    if kind == "flow":
        pol = flow_policy(tiny_pixel_model, "model.lora.enabled=true", "model.lora.rank=4")
        m = pol.model
        g = torch.Generator().manual_seed(1)
        x, sigma = torch.randn(2, *m.latent_shape, generator=g), torch.tensor([0.8, 0.4])
        enc, pooled = m.encode_prompts([ex["prompt"] for ex in EXAMPLES])

        def head():
            with torch.no_grad():
                return m.velocity(x, sigma, enc, pooled, 2.0, m.negative(2))  # [2, C, H, W]
        examples, outputs = EXAMPLES, lambda ro: ro.outputs
    else:
        from test_vlm_policy import LM_PROMPTS, policy_for, tiny_lm

        pol = policy_for(tiny_lm(tmp_path / "lm"), lora=True)
        batch = pol.processor(text=[p["prompt"] for p in LM_PROMPTS], return_tensors="pt", padding=True)

        def head():
            with torch.no_grad():
                return pol.model(**batch).logits  # [2, L, V]
        examples, outputs = LM_PROMPTS, lambda ro: ro.extras["completion_ids"]

    def run():
        ro = pol.sample(examples, 2, torch.Generator().manual_seed(0))
        lp, grads = _step(pol, ro, len(ro))
        return {"out": outputs(ro).float(), "old": ro.old_log_prob, "head": head(), "lp": lp}, grads

    keys = list(pol.trainable_modules()[0].state_dict())
    eager, eager_grads = run()
    blocks = compile_blocks(pol.trainable_modules(), pol.device)
    compiled, compiled_grads = run()
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert list(pol.trainable_modules()[0].state_dict()) == keys
    scale = max(v.abs().max().item() for v in eager_grads.values())
    diffs = {k: (compiled[k] - eager[k]).abs().max().item() for k in eager}
    diffs["grad"] = _max_diff(eager_grads, compiled_grads)
    print(kind, diffs, "gradient scale", scale)
    assert scale > 0 and diffs["grad"] < 1e-4 * scale, diffs
    assert max(diffs[k] for k in ("head", "lp", "old")) < 1e-4, diffs
    assert diffs["out"] < 1e-4 if kind == "flow" else diffs["out"] == 0, diffs  # token: the same sampled ids


@pytest.mark.slow  # two trainer runs on 2 processes, each compiling: ~2-3 min each on a loaded 2-core machine
def test_compiled_ddp_and_fsdp_end_where_eager_one_process_ends(tiny_pixel_model, tmp_path):
    """train.compile=true under DDP and FSDP2 (blocks compiled after wrapping: FSDP2's hooks run inside them) on 2
    processes ends 2 iterations where an eager single process ends (measured: 5e-8)."""
    from safetensors.torch import load_file
    from test_distributed import run

    r = run(tiny_pixel_model, str(tmp_path / "single.safetensors"), "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    single = load_file(tmp_path / "single.safetensors")
    for mode in ("ddp", "fsdp"):
        r = run(tiny_pixel_model, str(tmp_path / f"{mode}.safetensors"), "--parallel", mode, "--steps", "2", "--set",
                "train.compile=true", procs=2)
        assert r.returncode == 0, r.stderr[-3000:]
        got = load_file(tmp_path / f"{mode}.safetensors")
        diff = max((single[k] - got[k]).abs().max().item() for k in single)
        assert diff < 1e-6, f"{mode} compiled: parameters differ from the eager single-process run by {diff}"
