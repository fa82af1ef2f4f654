"""GPU acceptance: on a machine with CUDA, check what CPU-only CI cannot.

    python scripts/gpu_check.py                  # the device tests on CUDA + two iterations of each GPU config
    python scripts/gpu_check.py --quick          # the configs only
    python scripts/gpu_check.py --device cpu     # the same iterations on CPU (no CUDA needed; what CI runs)

1. `pytest -m gpu tests/test_device.py`: the trainer's real step with the policy on CUDA, equal to the CPU step.
2. Every shipped GPU config (SD3.5 Flow-GRPO on GenEval, PickScore, OCR and GenEval + PickScore, and
   MixGRPO-Flash, FLUX.1, FLUX.2-dev and klein, FLUX.1 Kontext and Qwen-Image-Edit editing, Wan2.x T2V (also with
   VideoAlign) and I2V, Qwen-Image DiffusionNFT, Z-Image AWM, Qwen2.5-VL grounding, SmolLM2 arithmetic) on tiny
   random-init pipelines of the same real classes (each model family's tiny builder; the recipes' reward models
   likewise, mmrl/testing/tiny_rewards.py), in bf16 with gradient checkpointing and micro-batches, through the
   trainer's own loop: 2 iterations (the second timed), each saved and evaluated on the held-out prompts (outside
   autocast, as a run does), then a new trainer resumes the newest checkpoint and trains iteration 3. Peak memory
   is torch.cuda.max_memory_allocated (on CPU: the resident peak), for the first run and for the resumed one.
   `--only sd35 wan` runs the configs whose name contains one of the words.
Exits 2 when CUDA is asked for and absent. The last line is one JSON object: "ok", and per config "ok", the timed
iteration, "peak_mib" / "resume_peak_mib", "eval" (the end evaluation's figures), "resumed_at_iteration" (3) and
"iterations" (3), or "error" with its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# config -> the tiny model (a family's name, or a token model) whose overrides point it at the tiny model and world
GPU_CONFIGS = {
    "t2i/sd35_geneval_lora": "sd3",
    "t2i/sd35_pickscore_lora": "sd3",
    "t2i/sd35_ocr_lora": "sd3",
    "t2i/sd35_geneval_pickscore_lora": "sd3",
    "t2i/sd35_nft_geneval_lora": "sd3",
    "t2v/wan_videoalign_lora": "wan",
    "t2i/flux_lora": "flux",
    "t2i/sd35_mixgrpo_flash_lora": "sd3_flash",
    "t2i/qwen_image_nft_lora": "qwen_image",
    "t2i/z_image_awm_lora": "z_image",
    "t2i/flux2_klein_lora": "flux2_klein",
    "t2i/flux2_dev_lora": "flux2",
    "t2i/flux_kontext_edit_lora": "flux_kontext",
    "t2i/qwen_image_edit_lora": "qwen_image_edit",
    "t2v/wan_lora": "wan",
    "t2v/wan22_a14b_lora": "wan22",
    "t2v/wan22_i2v_a14b_lora": "wan22_i2v",
    "t2v/wan21_i2v_lora": "wan_i2v",
    "grounding/charades_qwen25vl_lora": "qwen_vl",
    "text/smollm2_arithmetic": "causal_lm",
}
# config -> the tiny stand-ins of its reward models (mmrl/testing/tiny_rewards.py) and its prompts
# (FLUX.2-dev's CLIP-score component has no tiny stand-in: open_clip's smallest model is ~150 M parameters; its
# PickScore component stands for both)
RECIPE_REWARDS = {"t2i/sd35_geneval_lora": "geneval", "t2i/sd35_mixgrpo_flash_lora": "geneval",
                  "t2i/sd35_nft_geneval_lora": "geneval", "t2i/sd35_pickscore_lora": "pickscore",
                  "t2i/sd35_geneval_pickscore_lora": "geneval_pickscore", "t2i/sd35_ocr_lora": "ocr",
                  "t2v/wan_videoalign_lora": "video_align", "t2i/flux_lora": "pickscore", "t2i/flux2_dev_lora": "pickscore",
                  "t2i/flux2_klein_lora": "pickscore", "t2i/qwen_image_nft_lora": "pickscore",
                  "t2i/z_image_awm_lora": "pickscore", "t2v/wan_lora": "video_ocr", "t2v/wan22_a14b_lora": "video_ocr"}


def recipe_overrides(tmp: str, device: str) -> dict[str, list[str]]:
    """The real recipes' rewards on tiny stand-ins, and prompt files for those that read one."""
    from mmrl.testing.tiny_rewards import recipe_reward_overrides

    rewards = recipe_reward_overrides(os.path.join(tmp, "rewards"), device)
    rewards["pickscore"] = ["reward.name=pickscore", *rewards["pickscore"]]  # a multi reward (FLUX.2-dev) replaced
    rewards["video_ocr"] = []  # the recipe's own: RapidOCR on frames (shipped in its wheel)
    prompts = {"pickscore": ["a cat on a sofa", "a red car at night", "two dogs in the snow"],
               "ocr": ['a sign that says "OPEN"', 'a mug with "MMRL" on it', 'a poster reading "HELLO"'],
               "video_ocr": ['a sign that says "OPEN"', 'a mug with "MMRL" on it', 'a poster reading "HELLO"'],
               "video_align": ["a red circle moving left", "a blue square moving up", "a car driving by"]}
    for kind, texts in prompts.items():
        path = os.path.join(tmp, f"{kind}_prompts.txt")
        with open(path, "w") as f:
            f.write("\n".join(texts) + "\n")
        rewards.setdefault(kind, []).extend([f"task.prompt_file={path}", f"task.kwargs.eval_file={path}"]
                                            if kind != "video_align" else [f"task.prompt_file={path}"])
    return {config: rewards[kind] for config, kind in RECIPE_REWARDS.items()}


def build_models(tmp: str) -> dict[str, list[str]]:
    """Tiny stand-ins of the real checkpoints (every model family's tiny builder), and the overrides each config needs
    to run on them: image-conditioned families read a prompt file whose rows carry an image."""
    import torch

    from mmrl.models.families import families
    from mmrl.models.qwen_vl import build_causal_lm, build_model, build_processor, build_tokenizer
    from tasks import shapes
    from tasks.grounding_world import ANSWER, PROMPT, build_world

    small = ["train.prompts_per_iter=2", "train.group_size=4", "train.minibatches=2", "train.grad_accum=1",
             "task.eval_prompts=2", "model.lora.rank=4", "model.lora.alpha=8"]
    flow = [*small, "model.sample_size=8", "sampler.num_steps=4", "sampler.eval_steps=2"]
    edits = os.path.join(tmp, "edits.jsonl")  # the same prompts with a conditioning image each, for edits and I2V
    shapes.render(shapes.parse("a red circle"), 64).save(os.path.join(tmp, "image.png"))
    with open(edits, "w") as f:
        for text in ("a red circle", "a blue square", "two green triangles", "a yellow circle"):
            f.write(json.dumps({"prompt": text, "image": "image.png"}) + "\n")
    out = {}
    for family in families():
        if family.tiny is None:
            continue
        path = os.path.join(tmp, family.name)
        family.tiny(0).save_pretrained(path)
        over = [f"model.path={path}", *flow]
        if family.transformer.startswith("Wan"):  # video: 5 frames of 4 x 4 latents
            over += ["model.sample_size=4", "model.num_frames=5"]
        if family.condition_images:
            over += ["task.name=prompt_file", f"task.prompt_file={edits}", "task.kwargs={}", "reward.name=shapes",
                     "reward.kwargs={}"] if not family.transformer.startswith("Wan") else \
                ["task.name=prompt_file", f"task.prompt_file={edits}", "task.kwargs={}",
                 "reward.name=temporal_consistency", "reward.kwargs={}"]
        out[family.name] = over
    out["sd3_flash"] = [*out["sd3"], "sampler.sde_window_size=2"]
    # Wan2.2 A14B's two experts (T2V; I2V without an image encoder), at the recipes' own steps and shift: 4 steps at
    # shift 12 would leave the low-noise expert no trainable step
    from mmrl.models.families import FAMILIES

    for name, pipe in (("wan22", FAMILIES["wan"].tiny(0, two_experts=True)),
                       ("wan22_i2v", FAMILIES["wan_i2v"].tiny(0, layout="wan22_a14b"))):
        pipe.save_pretrained(os.path.join(tmp, name))
        base = out["wan" if name == "wan22" else "wan_i2v"]
        out[name] = [f"model.path={os.path.join(tmp, name)}" if o.startswith("model.path=") else o
                     for o in base if not o.startswith(("sampler.num_steps=", "sampler.eval_steps="))]
    paths = {k: os.path.join(tmp, k) for k in ("qwen_vl", "causal_lm", "world")}
    torch.manual_seed(0)
    tok = build_tokenizer([PROMPT, ANSWER, "red green blue yellow circle square triangle appears shown visible"])
    build_model("qwen2_5_vl", tok, "tiny").save_pretrained(paths["qwen_vl"])
    build_processor("qwen2_5_vl", tok).save_pretrained(paths["qwen_vl"])
    lm_tok = build_tokenizer(["what is two plus three? 5 answer"])
    build_causal_lm(lm_tok).save_pretrained(paths["causal_lm"])
    lm_tok.save_pretrained(paths["causal_lm"])
    try:
        build_world(paths["world"], {"train": 4, "test": 2})
    except ImportError as e:  # PyAV writes the world's mp4 files: without it only the grounding recipe fails
        out["qwen_vl"] = ImportError(f"the grounding world needs PyAV to write its videos: {e}")
    out.setdefault("qwen_vl", [f"model.path={paths['qwen_vl']}", *small, "task.name=grounding_world", "task.kwargs={}",
                      f"task.kwargs.root={paths['world']}", "task.kwargs.train_videos=4", "task.kwargs.test_videos=2",
                      "sampler.max_new_tokens=8", "video.min_pixels=3136", "video.max_pixels=3136",
                      "video.total_pixels=null"])
    out["causal_lm"] = [f"model.path={paths['causal_lm']}", *small, "sampler.max_new_tokens=8"]
    return out


def recipe_config(config: str, overrides: list[str], device: str, out_dir: str, iterations: int):
    """The recipe on its tiny stand-ins, its training reward plus a term that varies within groups (the stand-ins'
    own scores are often constant: zero advantages would train nothing); evaluation keeps the recipe's reward."""
    from mmrl.compose import checked, load_config
    from mmrl.testing.tiny_rewards import with_spread

    return checked(with_spread(_recipe_config(config, overrides, device, out_dir, iterations)))


def _recipe_config(config: str, overrides: list[str], device: str, out_dir: str, iterations: int):
    from mmrl.compose import load_config

    return load_config(os.path.join(ROOT, "configs", config + ".yaml"), [
        *overrides, f"model.device={device}", "model.dtype=bfloat16", "train.mixed_precision=bf16",
        "train.gradient_checkpointing=true", "train.micro_batch=2", f"train.iterations={iterations}",
        "train.time_budget_min=0", f"log.out_dir={out_dir}", "log.tensorboard=false", "log.progress=false",
        "log.eval_at_start=false", "log.eval_every=1", "log.save_every=1", "log.keep_checkpoints=2"])


def trained_modules(policy) -> dict[str, list]:
    """{expert.module: copies of its trainable parameters} (a LoRA layer's A and B; a fully trained layer's weight),
    named by the expert that holds them (Wan2.2: transformer / transformer_2; token policies: model). Left out: the
    text stream's query and outputs in the last joint block of a model without single-stream blocks after it (SD3,
    Qwen-Image): nothing reads them, so no gradient reaches them (Flow-GRPO's LoRA targets include them too)."""
    import torch

    experts = policy.experts() if hasattr(policy, "experts") else [("model", policy.model)]
    out: dict[str, list] = {}
    for expert, module in experts:
        for name, p in module.named_parameters():
            if p.requires_grad:
                layer = name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0]
                if unread_text_stream(module, layer):
                    continue
                out.setdefault(f"{expert}.{layer}", []).append(p.detach().float().cpu().clone())
    return out


TEXT_STREAM = ("add_q_proj", "to_add_out", "txt_mlp", "ff_context")


def unread_text_stream(model, layer: str) -> bool:
    """Whether `layer` is a text-stream query / output of the last joint block, which nothing after it reads."""
    inner = getattr(model, "module", model)
    blocks = getattr(inner, "transformer_blocks", None)
    if blocks is None or getattr(inner, "single_transformer_blocks", None) is not None:
        return False
    last = f"transformer_blocks.{len(blocks) - 1}."
    return layer.startswith(last) and any(f".{t}" in layer for t in TEXT_STREAM)


class Peak:
    """Peak memory of a phase in MiB: torch.cuda.max_memory_allocated on CUDA, else what the process's resident
    peak (VmHWM) added over its size at the start."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda, self.torch = cuda, torch

    def __enter__(self):
        from mmrl.testing.memory import reset_peak

        if self.cuda:  # no /proc resident counters needed (gVisor's /proc has no clear_refs)
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            self.before = reset_peak()
        return self

    def __exit__(self, *exc):
        from mmrl.testing.memory import rss_kib

        if self.cuda:
            self.torch.cuda.synchronize()
            self.mib = self.torch.cuda.max_memory_allocated() / 2**20
        else:
            self.mib = (rss_kib("VmHWM") - self.before) / 1024


def check_recipe(config: str, overrides: list[str], device: str, out_dir: str) -> dict:
    """The recipe's real loop (Trainer.fit, as `mmrl train` runs it): 2 iterations, each followed by a save and
    an evaluation (the held-out benchmark outside autocast: at iteration 1 mid-run, at the end as results'
    eval_end); then a new Trainer resumes the newest checkpoint and trains iteration 3, as `--resume` does. The
    second iteration is the timed one (warm caches). Peaks: the first run (start-up, training, evaluations, saves)
    and the resumed one (start-up, load, one iteration, evaluation, save)."""
    import gc

    import torch

    from mmrl.trainer import Trainer

    cuda = device.startswith("cuda")
    with Peak(cuda) as peak:
        tr = Trainer(recipe_config(config, overrides, device, out_dir, 2))
        start = trained_modules(tr.policy)
        first = tr.fit()
    params_dtypes = sorted({str(p.dtype) for p in tr.params})
    after = trained_modules(tr.policy)
    unchanged = sorted(m for m in start if all(torch.equal(a, b) for a, b in zip(start[m], after[m])))
    del tr
    gc.collect()
    with Peak(cuda) as resume_peak:
        tr = Trainer(recipe_config(config, overrides, device, out_dir, 3))
        if not tr.resume():
            raise RuntimeError(f"no checkpoint to resume in {out_dir}/checkpoints after 2 iterations with save_every=1")
        resumed_at = tr.iteration  # iterations done before the resumed run: 2
        resumed = tr.fit()
    del tr
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if resumed_at != 2 or resumed["iterations"] != 3:
        raise RuntimeError(f"--resume continued at iteration {resumed_at + 1} and ended at {resumed['iterations']}; "
                           f"expected iteration 3 of 3")
    train = {r["step"]: r for r in map(json.loads, open(os.path.join(out_dir, "metrics.jsonl")))
             if "reward/overall_mean" in r}  # one line per trained iteration, the resumed run's appended
    if sorted(train) != [1, 2, 3]:  # step = iterations done
        raise RuntimeError(f"metrics.jsonl holds training lines for steps {sorted(train)}, expected [1, 2, 3]")
    if unchanged or not any(train[k].get("adv/abs_mean") for k in (1, 2)):
        raise RuntimeError(f"2 iterations left {len(unchanged)} of {len(start)} trained modules unchanged "
                           f"({unchanged[:4]}), advantages |A| {[train[k].get('adv/abs_mean') for k in (1, 2)]}: "
                           f"this recipe trains nothing there")
    m = train[2]
    eval_end = {k: v for k, v in first["eval_end"].items() if isinstance(v, (int, float))}
    return {"seconds": m["perf/iteration_s"], "samples_per_s": m["perf/samples_per_s"], "peak_mib": peak.mib,
            "resume_peak_mib": resume_peak.mib, "loss": m["train/loss"], "reward": m["reward/overall_mean"],
            "optimizer_steps": m["train/optimizer_steps"], "params_dtypes": params_dtypes, "eval": eval_end,
            "eval_after_resume": {k: v for k, v in resumed["eval_end"].items() if isinstance(v, (int, float))},
            "resumed_at_iteration": resumed_at + 1, "iterations": resumed["iterations"],
            "adv_abs_mean": [train[k].get("adv/abs_mean") for k in (1, 2)], "trained_modules": len(start),
            "experts": sorted({m.split(".")[0] for m in start}),
            "unchanged_modules": unchanged,
            "checkpoints": sorted(os.listdir(os.path.join(out_dir, "checkpoints")))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--quick", action="store_true", help="skip the pytest device tests")
    p.add_argument("--only", nargs="+", default=None, help="only the configs whose name contains one of these")
    p.add_argument("--real-size", action="store_true", help="FLUX.1-dev, SD3.5-M, Wan2.1-1.3B and Qwen2.5-VL-7B "
                   "recipes at real size, random weights, per-phase memory beside mmrl plan, seconds, MFU "
                   "(mmrl/testing/real_size.py)")
    p.add_argument("--scale", choices=("real", "reduced"), default=None, help="--real-size's model size (default: "
                   "real on cuda, reduced on cpu: the dry run)")
    p.add_argument("--set", nargs="+", default=None, metavar="KEY=VALUE",
                   help="--real-size: config overrides of every recipe, e.g. train.compile=true (compiled blocks)")
    args = p.parse_args()
    if args.real_size:
        from mmrl.testing import real_size

        return real_size.main(args)
    import torch

    result: dict = {"device": args.device, "cuda_available": torch.cuda.is_available()}
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run it on a GPU machine (or --device cpu for the CPU path)")
            print(json.dumps({**result, "error": "no CUDA device"}))
            return 2
        result["gpu"] = torch.cuda.get_device_name()
    if not args.quick and args.device.startswith("cuda"):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_device.py"], cwd=ROOT,
                           capture_output=True, text=True)
        result["device_tests"] = {"returncode": r.returncode, "summary": r.stdout.strip().splitlines()[-1:]}
    with tempfile.TemporaryDirectory() as tmp:
        overrides, rewards = build_models(tmp), recipe_overrides(tmp, args.device)
        result["configs"] = {}
        for config, model in GPU_CONFIGS.items():
            if args.only and not any(word in config for word in args.only):
                continue
            try:
                if isinstance(overrides[model], Exception):
                    raise overrides[model]
                res = check_recipe(config, overrides[model] + rewards.get(config, []), args.device,
                                   os.path.join(tmp, "run", config.replace("/", "_")))
                res["ok"] = True
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - report every config, then fail (torch.distributed.checkpoint's
                # CheckpointException derives from BaseException)
                res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            result["configs"][config] = res
            print(f"{config:36s} " + (f"{res['seconds']:.2f} s, {res['samples_per_s']:.1f} samples/s, peak "
                                      f"{res['peak_mib']:.0f} MiB (resumed: {res['resume_peak_mib']:.0f} MiB), eval overall "
                                      f"{res['eval'].get('overall', float('nan')):.4f} on {res['eval']['n']}, "
                                      f"resumed at iteration {res['resumed_at_iteration']}"
                                      if res["ok"] else res["error"].splitlines()[0]), flush=True)
    ok = all(r["ok"] for r in result["configs"].values()) and \
        result.get("device_tests", {}).get("returncode", 0) == 0
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
