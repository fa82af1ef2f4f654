"""Janus-Pro as a token policy whose actions are image tokens (mmrl/policy/janus.py), on a tiny random-init
JanusForConditionalGeneration (the real class; a 2-layer Llama, a 64-code VQ decoding 16 tokens to 16 x 16 images):
sampling equal to transformers' generate(generation_mode="image") under the same seed, the policy contract, CFG and
log-prob numbers by hand, LoRA saved and loaded back by peft, two iterations of the recipe through the trainer with
mmrl eval and mmrl sample on its run, and two processes (DDP, FSDP2) ending where one process ends.

Run as a script it is the worker of the several-process test (under torchrun)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mmrl.testing.janus import TEMPLATE, word_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs/t2i/janus_pro_geneval_lora.yaml")
PROMPTS = [{"prompt": "a red circle"}, {"prompt": "two blue squares left of a green triangle"}]
WORDS = ("a an the of photo red green blue yellow purple orange pink brown black white circle circles square squares "
         "triangle triangles one two three four left right above below dog cat car : , .").split()


def build_tiny_janus(path: str, seed: int = 0) -> str:
    """Save a tiny random-init JanusForConditionalGeneration with its JanusProcessor (a word-level tokenizer with
    Janus's special tokens and a BOS, Janus's chat template) at path."""
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusImageProcessor, JanusProcessor

    tok = word_tokenizer(WORDS)
    hidden = 32
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
                  projection_dim=hidden, num_image_tokens=16, mlp_ratio=2.0, depth=1)
    vq = dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32, channel_multiplier=[1, 1, 1],
              num_res_blocks=1, projection_dim=hidden, image_token_embed_dim=hidden, num_hidden_layers=2)
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                                                      image_token_id=tok.convert_tokens_to_ids("<image_placeholder>")))
    model.save_pretrained(path)
    ip = JanusImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    JanusProcessor(image_processor=ip, tokenizer=tok, chat_template=TEMPLATE, num_image_tokens=16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_janus(tmp_path_factory) -> str:
    return build_tiny_janus(str(tmp_path_factory.mktemp("models") / "tiny-janus"))


def policy_for(path, lora=False, cfg_scale=3.0, temperature=1.0, cfg_grad="full", micro_batch=0, rank=4, alpha=8, **kw):
    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.policy.janus import JanusPolicy, load_janus

    model, processor = load_janus(path)
    sampler = SamplerConfig(cfg_scale=cfg_scale, eval_cfg_scale=cfg_scale, temperature=temperature, cfg_grad=cfg_grad)
    return JanusPolicy(model=model, processor=processor, sampler_cfg=sampler,
                       lora_cfg=LoraConfig(enabled=lora, rank=rank, alpha=alpha), model_path=path,
                       micro_batch=micro_batch, **kw)


def perturb(params, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def hf_generate(model, processor, prompt: str, seed: int, cfg_scale: float, temperature: float) -> torch.Tensor:
    """transformers' own image generation of one prompt: tokens [1, A] after torch.manual_seed(seed). top_k=0: the
    whole codebook, as Janus-Pro's own sampler and T2I-R1 draw (transformers' GenerationConfig would add top-k 50)."""
    tok = processor.tokenizer
    model.generation_config.bos_token_id, model.generation_config.pad_token_id = tok.bos_token_id, tok.pad_token_id
    model.generation_config.generation_kwargs = {"boi_token_id": tok.convert_tokens_to_ids(processor.image_start_token)}
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                         add_generation_prompt=True)
    inputs = processor(text=chat, generation_mode="image", return_tensors="pt")
    torch.manual_seed(seed)
    return model.generate(**inputs, generation_mode="image", do_sample=True, guidance_scale=cfg_scale,
                          temperature=temperature, top_k=0)


# ------------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("cfg_scale, temperature", [(3.0, 1.0), (5.0, 0.7)])
def test_sampling_equals_transformers_generate(tiny_janus, cfg_scale, temperature):
    """Row r of a rollout (2 prompts of different lengths x 2, decoded in one left-padded batch) is transformers'
    generate of its prompt alone after torch.manual_seed(seed + r): the same 16 tokens and the same pixels."""
    pol = policy_for(tiny_janus, cfg_scale=cfg_scale, temperature=temperature)
    ro = pol.sample(PROMPTS, 2, torch.Generator().manual_seed(7))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(7)))
    token_diff = pixel_diff = 0.0
    for r in range(len(ro)):
        hf = hf_generate(pol.janus, pol.processor, ro.examples[r]["prompt"], seed + r, cfg_scale, temperature)
        with torch.no_grad():
            pixels = pol.janus.decode_image_tokens(hf).permute(0, 3, 1, 2).clamp(-1, 1)   # [1, 3, 16, 16]
        token_diff = max(token_diff, (hf[0] - ro.extras["image_ids"][r]).abs().max().item())
        pixel_diff = max(pixel_diff, (pixels[0] - ro.outputs[r]).abs().max().item())
    print(f"cfg {cfg_scale}, T {temperature}: max abs difference from transformers' generate: tokens {token_diff}, "
          f"pixels {pixel_diff:.2e}")
    assert ro.outputs.shape == (4, 3, 16, 16) and ro.extras["image_ids"].shape == (4, 16)
    assert len(set(map(tuple, ro.extras["image_ids"].tolist()))) == 4  # the rows differ
    assert token_diff == 0 and pixel_diff < 1e-5


def test_cfg_and_log_probs_by_hand(tiny_janus):
    """CFG: (u + s (c - u)) / T on hand numbers; the policy's log-probs equal log_softmax of the guided logits of a
    teacher-forced forward written out with transformers' own Janus modules, and the sampler's own log-probs."""
    pol = policy_for(tiny_janus, cfg_scale=3.0, temperature=2.0)
    c, u = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 1.0]])
    assert torch.equal(pol._guide(torch.cat([c, u]), 3.0), torch.tensor([[1.5, 2.0]]))  # ([0, 1] + 3 [1, 1]) / 2
    assert torch.equal(pol._guide(c, 1.0), torch.tensor([[0.5, 1.0]]))  # scale 1: the conditional row alone
    ro = pol.sample(PROMPTS[:1], 2, torch.Generator().manual_seed(0))
    janus, ids = pol.janus, ro.extras["image_ids"]                                          # [2, 16]
    prompt = pol.encode_prompt(PROMPTS[0])[0]                                               # [P]
    boi = pol.processor.tokenizer.convert_tokens_to_ids("<begin_of_image>")
    assert prompt[0] == pol.processor.tokenizer.bos_token_id and prompt[-1] == boi
    uncond = torch.where((prompt == prompt[0]) | (prompt == boi), prompt, torch.tensor(pol.pad_id))
    with torch.no_grad():
        want = []
        for row in ids:
            logits = []
            for p in (prompt, uncond):
                emb = torch.cat([janus.get_input_embeddings()(p[None]),
                                 janus.prepare_embeddings_for_image_generation(row[None, :-1])], 1)
                h = janus.model.language_model(inputs_embeds=emb).last_hidden_state[0, len(p) - 1:]  # [16, D]
                logits.append(janus.model.generation_head(h))                                      # [16, K]
            guided = (logits[1] + 3.0 * (logits[0] - logits[1])) / 2.0
            want.append(torch.log_softmax(guided, -1).gather(1, row[:, None])[:, 0])
        got = pol.log_prob(ro, torch.arange(2)).log_prob
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
    torch.testing.assert_close(ro.extras["rollout_log_prob"], got, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ contract
@pytest.mark.parametrize("lora, cfg_grad, micro_batch, cfg_scale", [(False, "full", 0, 3.0), (True, "cond", 3, 5.0),
                                                                     (False, "full", 2, 1.0)])
def test_policy_contract(tiny_janus, lora, cfg_grad, micro_batch, cfg_scale):
    from mmrl.policy.base import Policy
    from mmrl.testing.contract import check_policy

    pol = policy_for(tiny_janus, lora=lora, cfg_grad=cfg_grad, micro_batch=micro_batch, cfg_scale=cfg_scale)
    assert isinstance(pol, Policy)
    if lora:
        names = [n for n, p in pol.lm.named_parameters() if p.requires_grad]
        assert names and all("lora_" in n and "language_model" in n for n in names)
        perturb(pol.trainable_parameters())
    summary = check_policy(pol, PROMPTS, 3)
    # the contract recomputes the rollout's old log-probs; the sampler's own (KV-cached decoding) agree with them too
    ro = pol.sample(PROMPTS, 3, torch.Generator().manual_seed(0))
    sampler_dev = (ro.extras["rollout_log_prob"] - ro.old_log_prob).abs().max().item()
    print(f"janus contract (lora={lora}, cfg_grad={cfg_grad}, cfg {cfg_scale}): {summary}, "
          f"max |logp - sampler logp| {sampler_dev:.1e}")
    assert summary["actions"] == 16 and summary["max_ratio_error"] < 1e-5 and sampler_dev < 1e-5
    # a row is the same whichever rows are sampled with it (several processes sample parts of a batch)
    full = pol.sample(PROMPTS, 3, torch.Generator().manual_seed(4))
    part = pol.sample(PROMPTS, 3, torch.Generator().manual_seed(4), rows=torch.arange(2, 5))
    assert part.group_id.tolist() == [0, 1, 1] and torch.equal(part.extras["image_ids"], full.extras["image_ids"][2:5])


def test_gradients_of_cfg_grad(tiny_janus):
    """log p = log_softmax((u + s (c - u)) / T): cfg_grad=full differentiates both rows, cfg_grad=cond the
    conditional row only, so full = cond + the gradient through the unconditional row alone (written out here)."""
    from mmrl.policy.janus import positions

    pol = policy_for(tiny_janus, cfg_scale=3.0, temperature=1.5)
    ro = pol.sample(PROMPTS, 1, torch.Generator().manual_seed(0))
    ids, params = ro.extras["image_ids"], pol.trainable_parameters()

    def grad(loss):
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    grads = {}
    for mode in ("full", "cond"):
        pol.cfg_grad = mode
        grads[mode] = grad(pol.log_prob(ro, torch.arange(2)).log_prob.sum())
    prompt, mask = pol._collate([pol.encode_prompt(ex) for ex in PROMPTS], True)          # [4, P]
    image = ids[:, :-1].repeat(2, 1)
    mask = torch.cat([mask, torch.ones_like(image)], 1)
    with torch.no_grad():
        c = pol.lm(prompt[:2], image[:2], mask[:2], positions(mask[:2]), keep=16)[0]
    u = pol.lm(prompt[2:], image[2:], mask[2:], positions(mask[2:]), keep=16)[0]
    logp = torch.log_softmax((u + 3.0 * (c - u)) / 1.5, -1).gather(-1, ids[..., None])
    uncond_only = grad(logp.sum())
    assert grads["full"].abs().max() > 1e-3 and uncond_only.abs().max() > 1e-3
    torch.testing.assert_close(grads["full"], grads["cond"] + uncond_only, rtol=1e-4, atol=1e-6)


def test_reference_and_config_errors(tiny_janus):
    from mmrl.compose import load_config
    from mmrl.errors import ConfigError
    from mmrl.policy.janus import check_janus_config

    pol = policy_for(tiny_janus, lora=True)
    ro = pol.sample(PROMPTS[:1], 2, torch.Generator().manual_seed(0))
    base = pol.log_prob(ro, torch.arange(2)).log_prob.detach()
    perturb(pol.trainable_parameters())
    with torch.no_grad(), pol.reference():
        torch.testing.assert_close(pol.log_prob(ro, torch.arange(2)).log_prob, base)   # adapters off: the base
    assert (pol.log_prob(ro, torch.arange(2)).log_prob.detach() - base).abs().max() > 1e-3
    for item, match in [("sampler.num_steps=4", "sampler.num_steps does not apply to model.policy=janus"),
                        ("sampler.top_p=0.9", "sampler.top_p does not apply"),
                        ("sampler.temperature=0", "greedy decoding"),
                        ("algo.kl_coef=0.01", r"set algo.kl to one of \['k1', 'k2', 'k3'\]"),  # mmrl.compose
                        ("algo.objective.name=nft", "forward process of final samples, which flow policies record")]:
        with pytest.raises(ConfigError, match=match):
            extra = ["algo.kl=flow_mean"] if item.startswith("algo.kl_coef") else []
            check_janus_config(load_config(RECIPE, [item, *extra]))
    from mmrl.preflight import check  # mmrl validate runs the same checks, before any weight loads

    problems = check(load_config(RECIPE, [f"model.path={tiny_janus}", "sampler.temperature=0"]))
    assert any("greedy decoding" in p for p in problems)
    assert not any("model.path" in p for p in problems)  # the folder has a config.json


# ------------------------------------------------------------------------------------------------ save / load
def test_lora_saved_and_loaded_back_by_peft(tiny_janus, tmp_path):
    """The saved adapter loads with PeftModel.from_pretrained on the base Janus: transformers' generate then gives
    the policy's tokens and pixels; load_trainable_state into a fresh policy gives its log-probs. Full fine-tuning
    saves a folder JanusForConditionalGeneration.from_pretrained loads with the trained weights."""
    from peft import PeftModel
    from transformers import JanusForConditionalGeneration

    pol = policy_for(tiny_janus, lora=True)
    perturb(pol.trainable_parameters())
    pol.save_pretrained(str(tmp_path / "lora"))
    assert json.load(open(tmp_path / "lora" / "mmrl_policy.json"))["policy"] == "janus"
    base = JanusForConditionalGeneration.from_pretrained(tiny_janus)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "lora"))
    ro = pol.sample(PROMPTS[:1], 1, torch.Generator().manual_seed(3))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(3)))
    hf = hf_generate(loaded.get_base_model(), pol.processor, PROMPTS[0]["prompt"], seed, 3.0, 1.0)
    with torch.no_grad():
        pixels = loaded.get_base_model().decode_image_tokens(hf).permute(0, 3, 1, 2).clamp(-1, 1)
    assert torch.equal(hf, ro.extras["image_ids"]) and (pixels - ro.outputs).abs().max() < 1e-5
    again = policy_for(tiny_janus, lora=True)
    again.load_trainable_state(str(tmp_path / "lora"))
    torch.testing.assert_close(again.log_prob(ro, torch.arange(1)).log_prob, pol.log_prob(ro, torch.arange(1)).log_prob)

    full = policy_for(tiny_janus)
    perturb(full.trainable_parameters(), 0.05)
    full.save_pretrained(str(tmp_path / "full"))
    reloaded = policy_for(str(tmp_path / "full"))
    one = torch.arange(1)
    torch.testing.assert_close(reloaded.log_prob(ro, one).log_prob, full.log_prob(ro, one).log_prob)


# ------------------------------------------------------------------------------------------------ the recipe
def recipe(model: str, out: str, rewards: dict, *items: str):
    from mmrl.compose import load_config

    return load_config(RECIPE, [
        f"model.path={model}", "model.dtype=float32", "model.device=cpu", f"log.out_dir={out}",
        f"reward.kwargs.detector_path={rewards['owlv2']}", f"reward.kwargs.clip_path={rewards['clip']}",
        "reward.kwargs.device=cpu", "reward.kwargs.threshold=-1.0", "task.kwargs.tags=[colors]",
        "train.iterations=2", "train.prompts_per_iter=2", "train.group_size=4", "train.micro_batch=2",
        "train.mixed_precision=no", "train.threads=1", "log.tensorboard=false", "log.progress=false",
        "log.save_every=1", "log.eval_at_start=false", *items])


@pytest.fixture(scope="module")
def tiny_rewards(tmp_path_factory) -> dict:
    from mmrl.testing.tiny_rewards import tiny_clip, tiny_owlv2

    root = tmp_path_factory.mktemp("rewards")
    return {"owlv2": tiny_owlv2(str(root / "owlv2")), "clip": tiny_clip(str(root / "clip"))}


def test_recipe_trains_two_iterations_then_eval_and_sample(tiny_janus, tiny_rewards, tmp_path):
    """configs/t2i/janus_pro_geneval_lora.yaml on the tiny Janus and tiny GenEval reward models (OWLv2, CLIP): two
    iterations (LoRA, KL to the adapter-free reference, gradient checkpointing), checkpoints, the held-out
    evaluation; then mmrl eval and mmrl sample on the run."""
    from mmrl.eval import evaluate_checkpoints
    from mmrl.sample import sample
    from mmrl.trainer import Trainer

    out = str(tmp_path / "run")
    cfg = recipe(tiny_janus, out, tiny_rewards)
    assert cfg.model.policy == "janus" and cfg.algo.objective.name == "ppo_clip" and cfg.task.name == "geneval"
    tr = Trainer(cfg)
    res = tr.fit()
    assert res["iterations"] == 2 and res["eval_end"]["n"] > 0 and "correct/colors" in res["eval_end"]
    lines = [x for x in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "train/loss" in x]
    assert [x["step"] for x in lines] == [1, 2] and max(x["train/grad_norm"] for x in lines) > 0  # it learns
    # the sampler's log-probs (KV-cached decoding) against the checkpointed training forward's, same weights
    assert max(x["train/engine_ratio_dev"] for x in lines) < 1e-5
    policy = os.path.join(out, "checkpoints", "iter-000002", "policy")
    assert os.path.isfile(os.path.join(policy, "adapter_model.safetensors"))
    ev = evaluate_checkpoints(cfg, [out], progress=False)
    assert len(ev) == 2 and all(r["n"] == res["eval_end"]["n"] for r in ev.values())
    assert ev[out]["overall"] == res["eval_end"]["overall"]  # mmrl eval reproduces the run's last evaluation
    examples = tr.task.eval_examples()[:2]  # mmrl sample's default prompts: GenEval rows the reward can score
    written = sample(cfg, [("base", None), ("run", out)], examples, str(tmp_path / "samples"))
    rows = [json.loads(x) for x in open(written["samples"])]
    assert len(rows) == 4 and all("overall" in r for r in rows) and os.path.isfile(written["contact_sheet"])
    assert os.path.isfile(tmp_path / "samples" / "run" / "1.png")
    # mmrl export: the adapter fused into a plain Janus folder that scores as the trained policy does
    from mmrl.export import export

    trained = policy_for(tiny_janus, lora=True, rank=cfg.model.lora.rank, alpha=cfg.model.lora.alpha)
    trained.load_trainable_state(policy)
    merged = policy_for(export(out, str(tmp_path / "exported")))
    ro, rows = trained.sample(examples, 2, torch.Generator().manual_seed(0)), torch.arange(4)
    want = trained.log_prob(ro, rows).log_prob
    assert (want - policy_for(tiny_janus).log_prob(ro, rows).log_prob).abs().max() > 1e-6  # training moved it
    torch.testing.assert_close(merged.log_prob(ro, rows).log_prob, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ processes
def brightness(outputs, examples):
    """A reward with signal on random images: the mean pixel value in [0, 1]."""
    return [float((o.mean() + 1) / 2) for o in outputs]


def run_worker(model, out, parallel, procs, tuning="full"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    r = subprocess.run([*launch, os.path.abspath(__file__), model, out, parallel, tuning], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def one_process(tiny_janus, tmp_path_factory) -> str:
    """The single-process run of test_two_processes_end_where_one_ends: its final parameters (safetensors)."""
    out = str(tmp_path_factory.mktemp("janus-dist") / "one.safetensors")
    run_worker(tiny_janus, out, "none", 1)
    return out


@pytest.mark.parametrize("mode", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_processes_end_where_one_ends(tiny_janus, one_process, tmp_path, mode):
    """2 iterations (3 prompts x 4 images, 2 minibatches; full fine-tuning with a KL reference copy) on 2 processes
    (gloo) end with the single-process parameters; the run's last checkpoint gives a policy folder (under FSDP built
    from the shards) that loads with those parameters. FSDP2 in the default run (its ranks must run the same
    forwards), DDP with -m slow (~30 s each on 2 cores)."""
    from safetensors.torch import load_file

    from mmrl.checkpoint import policy_folder

    one = load_file(one_process)
    start = policy_for(tiny_janus).trainable_parameters()
    assert max((one[f"p{i}"] - p.detach()).abs().max().item() for i, p in enumerate(start)) > 1e-4  # it learns
    r = run_worker(tiny_janus, str(tmp_path / f"{mode}.safetensors"), mode, 2)
    assert "world 2" in r.stdout
    if mode == "fsdp":  # start-up: the trained path and its reference were read into shards, never whole
        for rank in (0, 1):
            rep = json.load(open(tmp_path / f"{mode}.safetensors.rank{rank}.json"))
            assert rep["meta_before_shard"] and rep["ref_meta_before_shard"], rep
            assert rep["live_sharded"] and rep["ref_sharded"], rep
            assert 0.4 < rep["local_fraction"] < 0.6 and 0.4 < rep["ref_local_fraction"] < 0.6, rep
            assert rep["live_equals_disk"] and rep["ref_equals_disk"], rep
    got = load_file(tmp_path / f"{mode}.safetensors")
    d = max((one[k] - got[k]).abs().max().item() for k in one)
    print(f"janus, {mode}: max abs difference from one process {d:.2e}")
    assert d < 1e-5, f"{mode}: {d}"
    saved = policy_for(policy_folder(str(tmp_path / f"run-{mode}"))).trainable_parameters()
    assert max((got[f"p{i}"] - p.detach()).abs().max().item() for i, p in enumerate(saved)) < 1e-6


@pytest.mark.slow  # ~50 s on 2 quiet cores; the flow policy's LoRA case runs by default (test_startup_memory.py)
def test_lora_on_two_fsdp_processes_starts_in_shards_and_ends_where_one_ends(tiny_janus, tmp_path):
    """LoRA under FSDP2 on 2 processes: the frozen base of the image-token path is read into shards (meta before,
    half of every tensor after, equal to the weight file), the adapters start in their shards where one process
    starts them (init_adapters: one generator, drawn whole), and 2 iterations end within 1e-5 of one process."""
    from safetensors.torch import load_file

    run_worker(tiny_janus, str(tmp_path / "one.safetensors"), "none", 1, "lora")
    r = run_worker(tiny_janus, str(tmp_path / "fsdp.safetensors"), "fsdp", 2, "lora")
    assert "world 2" in r.stdout
    for rank in (0, 1):
        rep = json.load(open(tmp_path / f"fsdp.safetensors.rank{rank}.json"))
        assert rep["meta_before_shard"] and rep["live_sharded"], rep
        assert 0.4 < rep["local_fraction"] < 0.6 and rep["live_equals_disk"], rep
        assert rep["adapters"] > 0 and rep["adapters_equal_one_process"], rep
    one, got = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "fsdp.safetensors")
    d = max((one[k] - got[k]).abs().max().item() for k in one)
    print(f"janus LoRA, fsdp: max abs difference from one process {d:.2e}")
    assert d < 1e-5, d


def worker(model: str, out: str, parallel: str, tuning: str = "full") -> None:
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.parallel.shards import full
    from mmrl.trainer import Trainer

    from safetensors.torch import load_file as load_weights

    from mmrl.policy.janus import JanusPolicy

    torch.set_num_threads(1)
    seen, parallelize = {}, JanusPolicy.parallelize

    def spy(self, wrap, parallel):  # what the policy holds between building and sharding
        seen["meta_before_shard"] = all(t.is_meta for t in self.lm.parameters())
        seen["ref_meta_before_shard"] = self._ref is not None and all(t.is_meta for t in self._ref.parameters())
        return parallelize(self, wrap, parallel)

    JanusPolicy.parallelize = spy
    lora = tuning == "lora"
    cfg = load_config(RECIPE, [
        f"model.path={model}", "model.dtype=float32", "model.device=cpu", f"model.lora.enabled={str(lora).lower()}",
        "model.lora.rank=4", "model.lora.alpha=8",
        f"log.out_dir={os.path.dirname(out)}/run-{parallel}", f"train.parallel={parallel}",
        "reward.name=test_janus:brightness", "reward.kwargs={}", f"algo.kl_coef={0 if lora else 0.01}",
        "train.prompts_per_iter=3",
        "train.group_size=4", "train.minibatches=2", "train.micro_batch=0", "train.gradient_checkpointing=false",
        "train.mixed_precision=no", "train.lr=1e-3", "train.iterations=2", "log.tensorboard=false",
        "log.eval_at_start=false", "log.progress=false"])
    tr = Trainer(cfg)
    if parallel == "fsdp" and lora:
        from mmrl.models.shard_load import file_key, is_adapter
        from mmrl.policy.janus import build_janus_policy

        disk = load_weights(os.path.join(model, "model.safetensors"))
        named = dict(tr.policy.lm.named_parameters())
        base = {n: t for n, t in named.items() if not is_adapter(n)}
        whole = dict(build_janus_policy(cfg).lm.named_parameters())  # one process's start (adapters by init_adapters)
        adapters = [n for n in named if is_adapter(n)]
        report = {"meta_before_shard": seen["meta_before_shard"],
                  "live_sharded": all(hasattr(t, "to_local") for t in named.values()),
                  "local_fraction": sum(t.to_local().numel() for t in base.values()) / sum(
                      t.numel() for t in base.values()),
                  "live_equals_disk": all(torch.equal(full(t).detach(), disk["model." + file_key(n)].to(t.dtype))
                                          for n, t in base.items()),
                  "adapters": len(adapters),
                  "adapters_equal_one_process": all(torch.equal(full(named[n]).detach(), whole[n].detach())
                                                    for n in adapters)}
        with open(f"{out}.rank{tr.dist.rank}.json", "w") as f:
            json.dump(report, f)
    elif parallel == "fsdp":
        disk = load_weights(os.path.join(model, "model.safetensors"))
        live, ref = dict(tr.policy.lm.named_parameters()), dict(tr.policy._ref.named_parameters())
        local = lambda ts: sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in ts) / sum(  # noqa
            t.numel() for t in ts)
        equal = lambda ps: all(torch.equal(full(t).detach(), disk["model." + n].to(t.dtype)) for n, t in ps.items())  # noqa
        report = {**seen, "live_sharded": all(hasattr(t, "to_local") for t in live.values()),
                  "ref_sharded": all(hasattr(t, "to_local") for t in ref.values()),
                  "local_fraction": local(live.values()), "ref_local_fraction": local(ref.values()),
                  "live_equals_disk": equal(live), "ref_equals_disk": equal(ref)}
        with open(f"{out}.rank{tr.dist.rank}.json", "w") as f:
            json.dump(report, f)
    for it in range(2):
        tr.iteration = it
        m = tr.step(it)
    tr.iteration = 2
    tr.save()  # the run's last checkpoint (train.iterations=2): it checks that the ranks agree
    params = {f"p{i}": full(q).detach().clone().contiguous() for i, q in enumerate(tr.params)}
    if tr.dist.main:
        save_file(params, out)
        print(f"world {tr.dist.world} reward {m['reward/overall_mean']:.4f} loss {m['train/loss']:.6f}", flush=True)
    tr.dist.close()


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    worker(*sys.argv[1:5])
