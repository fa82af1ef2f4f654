"""Peak resident memory per rank and per phase of a real-size fine-tune (full, or LoRA with --lora), 1 process
against 2 under FSDP2.

A shapes-world SD3Transformer2DModel of ~170 M parameters (8 layers, 12 heads x 64, caption_projection_dim 768;
random init, saved as a model folder like tasks/assets/shapes-base in a temporary folder) is fully fine-tuned with
a KL penalty (a frozen reference copy) and EMA: one Flow-GRPO iteration, a save, then a resume in new processes.
1 process (train.parallel=none) and 2 processes (torchrun, gloo, FSDP2) on the CPU.

Each rank marks its phases in-process: the peak resident memory (VmHWM, reset through /proc/self/clear_refs after
malloc_trim at each phase start) during start-up (imports, Trainer built and sharded), sampling (the rollout),
training (the optimization of that rollout: forwards, backwards, the AdamW step, the EMA update), save (a mid-run
checkpoint), final_save (the run's last checkpoint, which also writes the loadable policy/ folder) and resume (a new
Trainer loading the newest checkpoint). Memory attributed to the model is that peak minus the same run's
peak on the 2.3 M-parameter shapes base; the ratio of a rank's model memory to one process's is reported per
phase (the target: <= 0.6 on every rank at every phase).

glibc keeps freed large blocks in its heap once its dynamic mmap threshold has grown (a freed 30 MiB tensor raises
it to 32 MiB), so on CPU the resident size keeps what a GPU's caching allocator would reuse, and FSDP's per-block
all-gathers look like leaks. Every run therefore sets MALLOC_MMAP_THRESHOLD_=65536 (large tensors are mapped and
unmapped), the same for 1 and 2 processes; --glibc-default measures without it.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_dist.py              # ~170 M parameters, a few minutes
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_dist.py --quick      # 2 layers (38 M), about 4 minutes
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_dist.py --dtype bfloat16   # model.dtype bf16 (+ bf16 compute)
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_dist.py --policy janus      # the Janus policy (~160 M)
    OMP_NUM_THREADS=1 python benchmarks/bench_memory_dist.py --lora              # LoRA instead of full fine-tuning

--policy janus: the AR shapes world's Janus (tasks/assets/shapes-ar-base) with its language model widened to 12
layers of 1024 (~160 M parameters; --quick: 2 layers), the same phases, one token-GRPO iteration of
configs/t2i/shapes_ar_grpo.yaml with a k3 KL to a frozen reference copy and EMA; the base is the committed 1.15 M one.

The last line is one JSON object: {"params", "peaks_mib": {run: {rank: {phase: MiB}}}, "model_mib", "ratio"}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tasks/assets/shapes-base")
AR_BASE = os.path.join(ROOT, "tasks/assets/shapes-ar-base")
PHASES = ("startup", "sampling", "training", "save", "final_save", "resume")


def build_model(path: str, layers: int) -> int:
    """A shapes-world model folder with a large transformer (random init, fp32) beside the base's text encoder and
    tokenizer; returns its parameter count."""
    import torch
    from diffusers import SD3Transformer2DModel

    shutil.copytree(BASE, path, ignore=shutil.ignore_patterns("transformer"))
    config = {k: v for k, v in json.load(open(os.path.join(BASE, "transformer", "config.json"))).items()
              if not k.startswith("_")}
    config.update(num_layers=layers, num_attention_heads=12, attention_head_dim=64, caption_projection_dim=768)
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**config)
    model.save_pretrained(os.path.join(path, "transformer"))
    return sum(p.numel() for p in model.parameters())


def build_janus(path: str, layers: int) -> int:
    """The AR shapes world's Janus folder with a wide language model (random init, fp32) and the base's processor;
    returns its parameter count."""
    import torch
    from transformers import JanusConfig, JanusForConditionalGeneration

    shutil.copytree(AR_BASE, path, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = JanusConfig.from_pretrained(AR_BASE)
    hidden = 1024
    config.text_config.update(dict(hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=16, head_dim=64))
    config.vision_config.projection_dim = config.vq_config.projection_dim = config.vq_config.image_token_embed_dim = hidden
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def worker(spec: dict) -> None:
    """One rank of one run: the phases in order, their peaks (KiB) written to spec["out"] + rank."""
    import torch

    from mmrl.compose import load_config
    from mmrl.testing.memory import reset_peak, rss_kib
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    marks: dict[str, int] = {}
    cfg = load_config(os.path.join(ROOT, spec["config"]), spec["overrides"])
    tr = Trainer(cfg)
    marks["startup"] = rss_kib("VmHWM")  # since the process started: imports, loading, sharding, EMA

    def marked(name, fn):
        def run(*a, **k):
            reset_peak()
            out = fn(*a, **k)
            marks[name] = rss_kib("VmHWM")
            return out
        return run

    if spec["resume"]:
        marked("resume", tr.resume)()
    else:
        tr.collect = marked("sampling", tr.collect)
        tr.optimize = marked("training", tr.optimize)
        tr.iteration = 0
        tr.step(0)
        tr.iteration = 1
        marked("save", tr.save)()
        tr.iteration = tr.cfg.train.iterations  # the run's last save: it also writes the policy/ export
        marked("final_save", tr.save)()
    with open(f"{spec['out']}-{tr.dist.rank}.json", "w") as f:
        json.dump(marks, f)
    tr.dist.close()


LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=16"]  # --lora (KL: adapters disabled)
POLICIES = {  # --policy: (config, its overrides, the base whose peaks are subtracted, the builder of the large model)
    "flow": ("configs/t2i/shapes_grpo.yaml", ["sampler.num_steps=4", "sampler.sde_window_size=2",
                                              "sampler.sde_window_range=[0,2]"], BASE, build_model),
    "janus": ("configs/t2i/shapes_ar_grpo.yaml", ["algo.kl=k3"], AR_BASE, build_janus),
}


def launch(model: str, world: int, out_dir: str, tmp: str, quick: bool, glibc_default: bool = False,
           dtype: str = "float32", policy: str = "flow", lora: bool = False) -> dict[int, dict[str, float]]:
    """Train + save, then resume, on `world` processes; {rank: {phase: peak MiB}}."""
    config, extra = POLICIES[policy][:2]
    extra = [*extra, *(LORA if lora else [])]
    overrides = [f"model.path={model}", f"log.out_dir={out_dir}", "log.tensorboard=false", "log.progress=false",
                 "log.eval_at_start=false", "train.iterations=100", "train.time_budget_min=0", "log.save_every=1",
                 f"train.parallel={'fsdp' if world > 1 else 'none'}", "model.reference=auto", "algo.kl_coef=0.04",
                 "train.ema_decay=0.9", "train.prompts_per_iter=2", f"train.group_size={2 if quick else 4}",
                 "train.minibatches=1", "train.micro_batch=4", "task.eval_prompts=4", f"model.dtype={dtype}",
                 f"train.mixed_precision={'bf16' if dtype == 'bfloat16' else 'no'}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": os.getcwd(),
           **({} if glibc_default else {"MALLOC_MMAP_THRESHOLD_": "65536"})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] \
        if world > 1 else [sys.executable]
    peaks: dict[int, dict[str, float]] = {r: {} for r in range(world)}
    for resume in (False, True):
        spec = {"config": config, "overrides": overrides, "resume": resume, "out": os.path.join(tmp, f"marks-{world}-{int(resume)}")}
        r = subprocess.run([*cmd, os.path.abspath(__file__), "--worker", json.dumps(spec)], env=env,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{world} process(es), {'resume' if resume else 'train'} failed:\n{r.stderr[-4000:]}")
        for rank in range(world):
            for k, v in json.load(open(f"{spec['out']}-{rank}.json")).items():
                peaks[rank][k if not (resume and k == "startup") else "startup_resume"] = v / 1024
    return peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 2-layer transformer (38 M parameters), group size 2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model.dtype (the frozen reference's dtype; bfloat16 also sets train.mixed_precision=bf16)")
    p.add_argument("--world", type=int, default=2, help="processes of the FSDP2 run (default 2)")
    p.add_argument("--glibc-default", action="store_true", help="without MALLOC_MMAP_THRESHOLD_ (see above)")
    p.add_argument("--policy", default="flow", choices=sorted(POLICIES),
                   help="flow: the shapes SD3 (default); janus: the AR shapes world's Janus")
    p.add_argument("--lora", action="store_true", help="LoRA (rank 16 on the policy's targets) instead of full "
                   "fine-tuning: the frozen base at model.dtype, the KL through the disabled adapters")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    with tempfile.TemporaryDirectory() as tmp:
        big, (_, _, base, build) = os.path.join(tmp, "shapes-big"), POLICIES[args.policy]
        params = build(big, 2 if args.quick else (12 if args.policy == "janus" else 8))
        peaks = {}
        for name, model in (("base", base), ("big", big)):
            for world in (1, args.world):
                peaks[f"{name}-{world}"] = launch(model, world, os.path.join(tmp, f"run-{name}-{world}"), tmp,
                                                  args.quick, args.glibc_default, args.dtype, args.policy, args.lora)
    phases = [*PHASES, "startup_resume"]
    model = {w: {r: {ph: peaks[f"big-{w}"][r][ph] - peaks[f"base-{w}"][r][ph] for ph in phases}
                 for r in peaks[f"big-{w}"]} for w in (1, args.world)}
    one = model[1][0]
    ratio = {r: {ph: model[args.world][r][ph] / one[ph] for ph in phases} for r in model[args.world]}
    print(f"{params / 1e6:.1f} M parameters; model memory per phase (MiB, peak minus the shapes base's peak), "
          f"1 process and each rank of {args.world} under FSDP2:")
    print(f"{'phase':16s}{'1 process':>12s}" + "".join(f"{f'rank {r}':>18s}" for r in ratio))
    for ph in phases:
        print(f"{ph:16s}{one[ph]:12.0f}" + "".join(f"{model[args.world][r][ph]:10.0f} (x{ratio[r][ph]:.2f})"
                                                   for r in ratio))
    print(json.dumps({"params": params, "policy": args.policy, "lora": args.lora, "world": args.world,
                      "dtype": args.dtype, "peaks_mib": peaks,
                      "model_mib": model, "ratio": ratio, "worst_ratio": max(v for r in ratio.values() for v in r.values())}))


if __name__ == "__main__":
    main()
