"""Where FLUX.1's first backward goes non-finite in bf16 (issue 62, item 4): a matrix of one Flow-GRPO step each.

    python scripts/flux_nan_matrix.py --device cuda            # the whole matrix (a few minutes on one GPU)
    python scripts/flux_nan_matrix.py --device cpu --quick     # a subset on CPU (tests/test_flux_nan_matrix.py)

FLUX.1 and FLUX.1 Kontext got non-finite LoRA gradients in their first backward in bf16 on CUDA (scripts/gpu_check.py,
2026-11-27); on CPU in bf16 everything is finite. Every cell uses a tiny random-init `FluxTransformer2DModel` (the
flux family's tiny builder, head_dim 16; or the same config with head_dim 128, FLUX.1's, RoPE axes (16, 56, 56)) that
carries LoRA as mmrl's FlowPolicy adds it (the family's targets, peft "gaussian" A, zero B
from `init_adapters`, adapters upcast to fp32 by `upcast_trainable`, the rest frozen in the cell's dtype), and runs
one rollout-like step on fixed inputs (the same seeded latents, prompts' embeddings, SDE noise and advantages in
every cell): a no-grad forward gives the Flow-GRPO SDE step's mean, x_{t+1} and old log-prob (as the rollout does),
a second forward with gradients gives the new log-prob, and `ppo_clip` (clip_range 1e-4) times the advantages is
the loss, backpropagated once. Kontext is the same transformer called with the conditioning image's tokens
appended (mmrl.models.families.flux_kontext.kontext_call). Shapes: 4 transitions at steps spread over the trained
ones of a 6-step schedule (`--steps`), 16-channel latents of side 64 (1024 image tokens, FLUX.1's 512 px) and 512
text tokens on CUDA, side 16 and 32 tokens on CPU (`--size`, `--text-len`); LoRA r4 / alpha 8 on the attention
projections (`--ff`: the feed-forward ones too, as configs/t2i/flux_lora.yaml).

The matrix (every combination): model (flux, kontext) x head_dim (16, 128) x precision (fp32: fp32 weights;
bf16: bf16 weights, fp32 LoRA, no autocast; bf16_autocast: the same under bf16 autocast, what
train.mixed_precision=bf16 runs) x gradient checkpointing (off, on: diffusers' enable_gradient_checkpointing) x
advantages (zero, non-zero) x SDPA backend (default, math, flash, efficient, cudnn: torch.nn.attention.sdpa_kernel
around the forwards and the backward, whose checkpointed recompute runs there). On CPU efficient and cudnn are
reported "unavailable on this device" without running (flash runs: CPU has a flash kernel of its own); a backend
with no kernel for a cell's inputs (flash on fp32) is "no kernel for these inputs". `--quick`: flux only (no Kontext),
every other combination (120 cells, 72 of them run on CPU, about 15 s).

Per cell: "finite" or "non-finite", the LoRA gradient tensors that are not finite (module names), the transformer
blocks whose output gradients are not finite (the backward visits the blocks last to first: the non-finite values
were made in the backward of the block after the latest one listed, or above the blocks when the last is), whether the
forward's velocity was finite, the loss, the gradient norm and the clipped fraction. For the first non-finite cell,
probes: the cell again under torch.autograd.set_detect_anomaly(True) (the backward op that returned NaN, and the
forward frame that made it; anomaly mode flags NaN, not inf), and again with the input latents requiring grad (block
0's inputs then need a gradient too). Then bf16 against fp32 on the same inputs, LoRA init and noise (default
backend, no checkpointing, non-zero advantages), per model and head size: the cosine similarity and norm ratio
|g_bf16| / |g_fp32| of all LoRA gradients together and per tensor (tensors whose fp32 gradient is zero, every lora_A
at the first step since B = 0, are counted apart).

Prints a progress line per cell, the table, the comparison; the last line of stdout is one JSON object: "cells"
(every cell's outcome), "summary", "first_nonfinite", "probes", "comparison". Exits 2 when CUDA is asked for and absent.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass

import torch

MODELS = ("flux", "kontext")
HEADS = (16, 128)
PRECISIONS = ("fp32", "bf16", "bf16_autocast")
CHECKPOINTING = (False, True)
ADVANTAGES = ("zero", "nonzero")
BACKENDS = ("default", "math", "flash", "efficient", "cudnn")
CPU_UNAVAILABLE = ("efficient", "cudnn")  # CUDA-only SDPA kernels (CPU has math and a flash kernel of its own)
GUIDANCE = {"flux": 3.5, "kontext": 2.5}  # model.guidance of configs/t2i/flux_lora.yaml, Kontext's model card
CLIP_RANGE, NOISE_LEVEL = 1e-4, 0.9  # configs/t2i/flux_lora.yaml
FF_TARGETS = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")  # flux_lora.yaml's extra
UNAVAILABLE, NO_KERNEL = "unavailable on this device", "no kernel for these inputs"


@dataclass(frozen=True)
class Cell:
    model: str
    head_dim: int
    precision: str
    checkpointing: bool
    advantage: str
    backend: str

    @property
    def key(self) -> str:
        return (f"{self.model}/h{self.head_dim}/{self.precision}/{'ckpt' if self.checkpointing else 'no_ckpt'}/"
                f"adv_{self.advantage}/{self.backend}")


def matrix(quick: bool) -> list[Cell]:
    """Every cell, grouped so that one transformer (model, head_dim, precision) serves consecutive cells."""
    models = MODELS[:1] if quick else MODELS
    return [Cell(*c) for c in itertools.product(models, HEADS, PRECISIONS, CHECKPOINTING, ADVANTAGES, BACKENDS)]


# ------------------------------------------------------------------------------------------------------ models
def flux_family():
    from mmrl.models.families import families

    return next(f for f in families() if f.name == "flux")


@contextlib.contextmanager
def quiet_stdout():
    """File descriptor 1 to /dev/null for the block (the tokenizers library's trainer prints blank lines there)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


@functools.cache
def tiny_pipeline(seed: int):
    """The flux family's tiny FluxPipeline (text encoders, VAE and all; only its transformer and scheduler config
    are used), built once."""
    with quiet_stdout():
        return flux_family().tiny(seed)


def base_transformer(head_dim: int, seed: int):
    """(fp32 FluxTransformer2DModel, scheduler config): a copy of the flux family's tiny one (head_dim 16), or its
    config with FLUX.1's head_dim 128 and RoPE axes (16, 56, 56) (2 heads: inner dim 256), random init from `seed`."""
    from diffusers import FluxTransformer2DModel

    pipe = tiny_pipeline(seed)
    tr = copy.deepcopy(pipe.transformer)
    if head_dim != tr.config.attention_head_dim:
        if head_dim != 128:
            raise ValueError(f"--head-dim {head_dim}: 16 (the tiny builder's) or 128 (FLUX.1's)")
        torch.manual_seed(seed)
        tr = FluxTransformer2DModel.from_config({**tr.config, "attention_head_dim": 128,
                                                 "axes_dims_rope": (16, 56, 56)})
    return tr.float(), dict(pipe.scheduler.config)


def with_lora(tr, dtype: torch.dtype, rank: int, alpha: float, seed: int, b_std: float, ff: bool = False):
    """A copy of `tr` in `dtype` with LoRA as FlowPolicy adds it: frozen base, the family's targets, fp32 adapters
    (upcast_trainable), A from init_adapters' seeded draw, B zero (or N(0, b_std) to look past the first step);
    `ff`: the feed-forward projections too (configs/t2i/flux_lora.yaml's target_modules)."""
    from peft import LoraConfig

    from mmrl.models.families import lora_targets
    from mmrl.models.shard_load import init_adapters
    from mmrl.policy.base import upcast_trainable
    from mmrl.seeds import derive_seed

    tr = copy.deepcopy(tr).to(dtype)
    tr.requires_grad_(False)
    tr.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                              target_modules=lora_targets(flux_family()) + list(FF_TARGETS if ff else ())))
    upcast_trainable(tr)
    init_adapters(tr, "gaussian", derive_seed(seed, "lora_init", 0))
    if b_std:
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in tr.named_parameters():
            if ".lora_B." in name:
                p.data.copy_(torch.randn(p.shape, generator=g) * b_std)
    return tr.train()


def lora_params(tr) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in tr.named_parameters() if p.requires_grad}


def module_of(param: str) -> str:
    """'transformer_blocks.0.attn.to_q.lora_A.default.weight' -> 'transformer_blocks.0.attn.to_q.lora_A'."""
    return param.replace(".default.weight", "").replace(".weight", "")


# ------------------------------------------------------------------------------------------------------ inputs
@dataclass
class Batch:
    x: torch.Tensor           # [N, 16, H, W] x_t
    sigma: torch.Tensor       # [N]
    sigma_next: torch.Tensor  # [N]
    enc: torch.Tensor         # [N, L, D] T5 tokens
    pooled: torch.Tensor      # [N, P] CLIP pooled
    image: torch.Tensor       # [N, 16 * H * W] Kontext's conditioning latents z, flattened
    noise: torch.Tensor       # [N, 16, H, W] the SDE step's noise
    adv: torch.Tensor         # [N] non-zero advantages
    sigma_max: float          # the first sigma below 1 (Flow-GRPO's pole guard)


def make_batch(tr, scheduler_config: dict, n: int, size: int, text_len: int, steps: int, seed: int, device) -> Batch:
    """Seeded fp32 inputs, the same in every cell: rows at steps spread over the trained window 0 .. S-2 of FLUX's
    resolution-shifted schedule, x_t = (1 - sigma) x0 + sigma eps with x0, eps ~ N(0, I)."""
    from mmrl.models.families.common import dynamic_schedule, dynamic_shift_mu

    g = torch.Generator().manual_seed(seed)
    sigmas = dynamic_schedule(dynamic_shift_mu((size // 2) ** 2, scheduler_config))(steps)  # [S + 1]
    steps = torch.linspace(0, steps - 2, n).round().long()                                  # [N] step indices
    c, d, p = tr.config.in_channels // 4, tr.config.joint_attention_dim, tr.config.pooled_projection_dim
    sigma = sigmas[steps]
    x0, eps = torch.randn(n, c, size, size, generator=g), torch.randn(n, c, size, size, generator=g)
    s = sigma.view(-1, 1, 1, 1)
    parts = dict(x=(1 - s) * x0 + s * eps, sigma=sigma, sigma_next=sigmas[steps + 1],
                 enc=torch.randn(n, text_len, d, generator=g), pooled=torch.randn(n, p, generator=g),
                 image=torch.randn(n, c * size * size, generator=g), noise=torch.randn(n, c, size, size, generator=g),
                 adv=torch.linspace(1.5, -1.5, n))
    return Batch(**{k: v.to(device) for k, v in parts.items()}, sigma_max=float(sigmas[1]))


# ------------------------------------------------------------------------------------------------------ one step
def sdpa_backend(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    names = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION"}
    return sdpa_kernel([getattr(SDPBackend, names[backend])])


def call_for(model: str):
    from mmrl.models.families.flux import flux_call
    from mmrl.models.families.flux_kontext import kontext_call

    return (flux_call if model == "flux" else kontext_call)(GUIDANCE[model])


def velocity(tr, call, model: str, b: Batch, x: torch.Tensor) -> torch.Tensor:
    """v [N, 16, H, W] in fp32, as FlowModel._expert computes it: inputs cast to the transformer's compute dtype,
    sigma kept fp32; Kontext's pooled row carries the image latents after CLIP's [N, P + 16 H W]."""
    from mmrl.models.flow_model import compute_dtype

    dtype = compute_dtype(tr)
    pooled = b.pooled if model == "flux" else torch.cat([b.pooled, b.image], 1)
    return call(tr, x.to(dtype), b.sigma, b.enc.to(dtype), pooled.to(dtype)).float()


class BlockWatch:
    """Forward hooks on every double- and single-stream block: whether each block's outputs were finite in the
    forward, and whether the gradients reaching them in the backward were (a tensor hook on each output that
    requires grad; under checkpointing the recompute's outputs are not in the graph and never report)."""

    def __init__(self, tr):
        self.forward_nonfinite, self.grad_nonfinite = set(), set()
        blocks = [(f"transformer_blocks.{i}", m) for i, m in enumerate(tr.transformer_blocks)]
        blocks += [(f"single_transformer_blocks.{i}", m) for i, m in enumerate(tr.single_transformer_blocks)]
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in blocks]

    def _hook(self, name: str):
        def hook(module, args, out):
            for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                if not torch.is_tensor(t):
                    continue
                if not bool(torch.isfinite(t).all()):
                    self.forward_nonfinite.add(f"{name}[{i}]")
                if t.requires_grad:
                    t.register_hook(self._grad(f"{name}[{i}]"))

        return hook

    def _grad(self, label: str):
        def hook(grad):
            if not bool(torch.isfinite(grad).all()):
                self.grad_nonfinite.add(label)

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def step_loss(tr, cell: Cell, b: Batch, autocast: bool, inputs_grad: bool = False):
    """One rollout-like Flow-GRPO step's loss (scalar) and stats: the no-grad forward samples x_{t+1} and its old
    log-prob, the forward with gradients gives the new log-prob, ppo_clip times the advantages."""
    from mmrl.algorithms.losses import PPOKnobs, ppo_clip
    from mmrl.sampling.flow_sde import gaussian_log_prob, step_mean_std

    call = call_for(cell.model)
    amp = torch.autocast(b.x.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    adv = b.adv if cell.advantage == "nonzero" else torch.zeros_like(b.adv)
    with amp:
        with torch.no_grad():
            v_old = velocity(tr, call, cell.model, b, b.x)                                         # [N, C, H, W]
        mean_old, std = step_mean_std("flow_grpo", b.x, v_old, b.sigma, b.sigma_next, NOISE_LEVEL, b.sigma_max)
        nxt = mean_old + std.view(-1, 1, 1, 1) * b.noise                                          # x_{t+1}
        old_lp = gaussian_log_prob(nxt, mean_old, std)                                            # [N]
        x = b.x.clone().requires_grad_(True) if inputs_grad else b.x
        v = velocity(tr, call, cell.model, b, x)
        mean, _ = step_mean_std("flow_grpo", x, v, b.sigma, b.sigma_next, NOISE_LEVEL, b.sigma_max)
        lp = gaussian_log_prob(nxt, mean, std)                                                    # [N]
        loss, stats = ppo_clip(lp[:, None], old_lp[:, None], adv, PPOKnobs(CLIP_RANGE, None, 0.0))  # [N, 1]
    return loss.mean(), {"velocity_finite": bool(torch.isfinite(v).all()), "clip_frac": float(stats["clipped"].mean())}


def run_step(tr, cell: Cell, b: Batch, inputs_grad: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """One cell: (its record, the LoRA gradients on the CPU in fp32)."""
    params = lora_params(tr)
    for p in params.values():
        p.grad = None
    if cell.checkpointing:
        tr.enable_gradient_checkpointing()
    else:
        tr.disable_gradient_checkpointing()
    watch = BlockWatch(tr)
    try:
        with sdpa_backend(cell.backend):  # the backward too: a checkpointed block recomputes its attention there
            loss, stats = step_loss(tr, cell, b, cell.precision == "bf16_autocast", inputs_grad)
            loss.backward()
    finally:
        watch.close()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
             for n, p in params.items()}
    bad = [n for n, g in grads.items() if not bool(torch.isfinite(g).all())]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    record = {"outcome": "finite" if not bad else "non-finite", "nonfinite_tensors": len(bad), "tensors": len(grads),
              "nonfinite_modules": sorted({module_of(n) for n in bad}), **stats,
              "forward_nonfinite_blocks": sorted(watch.forward_nonfinite),
              "grad_nonfinite_blocks": sorted(watch.grad_nonfinite), "loss": finite_or_none(float(loss.detach())),
              "grad_norm": finite_or_none(norm), "missing_grads": sum(p.grad is None for p in params.values())}
    return record, grads


def finite_or_none(x: float):
    return x if math.isfinite(x) else None


def run_cell(tr, cell: Cell, b: Batch, device: str) -> tuple[dict, dict | None]:
    """A cell's record (with its key and seconds), or the backend's absence on this device / for these inputs."""
    base = {"key": cell.key, **cell.__dict__}
    if device == "cpu" and cell.backend in CPU_UNAVAILABLE:
        return {**base, "outcome": UNAVAILABLE}, None
    t0 = time.perf_counter()
    try:
        record, grads = run_step(tr, cell, b)
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            return {**base, "outcome": "error", "error": str(e).splitlines()[0][:300]}, None
        return {**base, "outcome": NO_KERNEL}, None
    return {**base, **record, "seconds": round(time.perf_counter() - t0, 3)}, grads


# ------------------------------------------------------------------------------------------------------ probes
def anomaly_op(fn) -> dict:
    """Run `fn` (a forward + backward) under torch.autograd.set_detect_anomaly(True): the backward op that returned
    NaN ("op"), the error's first line and the last forward frames anomaly mode printed for it; {"op": None} when
    nothing was flagged."""
    with warnings.catch_warnings(record=True) as caught, torch.autograd.set_detect_anomaly(True):
        warnings.simplefilter("always")
        try:
            fn()
        except RuntimeError as e:
            text = str(e)
            op = re.search(r"Function '(\w+)' returned nan", text)
            frames = [line.strip() for w in caught for line in str(w.message).splitlines()
                      if line.strip().startswith("File ")]
            return {"op": op.group(1) if op else None, "error": text.splitlines()[0][:300],
                    "forward_frames": frames[-6:]}
    return {"op": None, "error": None, "forward_frames": [],
            "note": "no NaN flagged in the backward (anomaly mode does not flag inf)"}


def probes(tr, cell: Cell, b: Batch) -> dict:
    """The first non-finite cell again: under anomaly detection, then with the input latents requiring grad."""
    def once():
        run_step(tr, cell, b)

    out = {"cell": cell.key, "anomaly": anomaly_op(once)}
    try:
        record, _ = run_step(tr, cell, b, inputs_grad=True)
        out["inputs_require_grad"] = {k: record[k] for k in ("outcome", "nonfinite_tensors", "nonfinite_modules")}
    except RuntimeError as e:
        out["inputs_require_grad"] = {"outcome": "error", "error": str(e).splitlines()[0][:300]}
    return out


# ------------------------------------------------------------------------------------------------------ comparison
def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a.double().flatten(), b.double().flatten()
    den = float(a.norm() * b.norm())
    return finite_or_none(float(a @ b) / den) if den > 0 else None


def ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
    den = float(b.double().norm())
    return finite_or_none(float(a.double().norm()) / den) if den > 0 else None


def compare(low: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """bf16 gradients `low` against fp32's `ref` (same names): overall cosine and norm ratio |low| / |ref| of all
    tensors concatenated, per tensor for those whose fp32 gradient is non-zero, and the count of zero ones."""
    names = sorted(ref)
    live = [n for n in names if float(ref[n].abs().max()) > 0]
    per = {n: {"cosine": cosine(low[n], ref[n]), "norm_ratio": ratio(low[n], ref[n])} for n in live}
    cos = [v["cosine"] for v in per.values() if v["cosine"] is not None]
    flat_low, flat_ref = (torch.cat([g[n].flatten() for n in names]) for g in (low, ref))  # [sum of numels]
    return {"cosine": cosine(flat_low, flat_ref), "norm_ratio": ratio(flat_low, flat_ref),
            "min_tensor_cosine": min(cos) if cos else None,
            "median_tensor_cosine": sorted(cos)[len(cos) // 2] if cos else None,
            "tensors_compared": len(live), "tensors_zero_in_fp32": len(names) - len(live), "per_tensor": per}


def comparisons(grads: dict[str, dict], cells: list[Cell]) -> dict:
    """For each (model, head_dim): bf16 and bf16_autocast against fp32 in the default-backend, no-checkpointing,
    non-zero-advantage cell."""
    out = {}
    for model, head in sorted({(c.model, c.head_dim) for c in cells}):
        key = lambda prec: Cell(model, head, prec, False, "nonzero", "default").key  # noqa: E731
        if key("fp32") not in grads:
            continue
        for prec in PRECISIONS[1:]:
            if key(prec) in grads:
                out[f"{model}/h{head}/{prec}_vs_fp32"] = compare(grads[key(prec)], grads[key("fp32")])
    return out


# ------------------------------------------------------------------------------------------------------ report
def short(record: dict) -> str:
    o = record["outcome"]
    if o == "finite":
        return "ok"
    if o == "non-finite":
        return f"NaN {record['nonfinite_tensors']}/{record['tensors']}"
    return {UNAVAILABLE: "n/a", NO_KERNEL: "no-kernel"}.get(o, "error")


def print_table(records: list[dict]) -> None:
    """One row per (model, head_dim, precision, checkpointing, advantage), one column per backend."""
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault((r["model"], r["head_dim"], r["precision"], r["checkpointing"], r["advantage"]), {})[
            r["backend"]] = short(r)
    head = f"{'model':8} {'head':>4} {'precision':14} {'ckpt':5} {'adv':8}" + "".join(f"{b:>11}" for b in BACKENDS)
    print(head)
    for (m, h, p, c, a), cols in rows.items():
        print(f"{m:8} {h:>4} {p:14} {'on' if c else 'off':5} {a:8}" + "".join(f"{cols.get(b, '-'):>11}"
                                                                               for b in BACKENDS))


def print_comparison(comp: dict) -> None:
    fmt = lambda x: "  -  " if x is None else f"{x:.4f}"  # noqa: E731
    print(f"{'bf16 vs fp32 (default SDPA, no ckpt, adv != 0)':44} {'cosine':>8} {'norm ratio':>11} "
          f"{'min t.cos':>10} {'med t.cos':>10} {'tensors':>8}")
    for name, c in comp.items():
        print(f"{name:44} {fmt(c['cosine']):>8} {fmt(c['norm_ratio']):>11} {fmt(c['min_tensor_cosine']):>10} "
              f"{fmt(c['median_tensor_cosine']):>10} {c['tensors_compared']:>4}+{c['tensors_zero_in_fp32']}z")


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="flux only (no Kontext): the CPU test's subset")
    ap.add_argument("--head-dim", type=int, nargs="+", choices=HEADS, default=list(HEADS),
                    help="attention head sizes to build: 16 (the tiny builder's), 128 (FLUX.1's)")
    ap.add_argument("--batch", type=int, default=4, help="transitions per training forward (flux_lora's micro_batch)")
    ap.add_argument("--size", type=int, default=None,
                    help="latent side H = W (tokens H W / 4); default 64 (512 px, FLUX.1's recipe) on CUDA, 16 on CPU")
    ap.add_argument("--text-len", type=int, default=None, help="T5 tokens; default 512 on CUDA, 32 on CPU")
    ap.add_argument("--steps", type=int, default=6, help="sampler.num_steps (flux_lora.yaml's 6; gpu_check ran 4)")
    ap.add_argument("--ff", action="store_true", help="LoRA on the feed-forward projections too (flux_lora.yaml)")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--lora-b-std", type=float, default=0.0,
                    help="start LoRA B at N(0, std) instead of 0 (lora_A then gets a gradient too: past step one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA asked for and absent", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # "modules that should be kept in float32: []" on every cast to bf16
    cuda = args.device == "cuda"
    size, text_len = args.size or (64 if cuda else 16), args.text_len or (512 if cuda else 32)
    cells = [c for c in matrix(args.quick) if c.head_dim in args.head_dim]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.bfloat16}
    records, grads, first, models, batches = [], {}, None, {}, {}
    t0 = time.perf_counter()
    for i, cell in enumerate(cells):
        group = (cell.head_dim, cell.precision)
        if group not in models:  # one transformer per head size and precision: flux and Kontext share it
            models.clear()
            base, sched = base_transformer(cell.head_dim, args.seed)
            models[group] = with_lora(base, dtypes[cell.precision], args.rank, args.alpha, args.seed,
                                      args.lora_b_std, args.ff).to(args.device)
            if cell.head_dim not in batches:
                batches[cell.head_dim] = make_batch(base, sched, args.batch, size, text_len, args.steps, args.seed,
                                                 args.device)
        tr, b = models[group], batches[cell.head_dim]
        record, g = run_cell(tr, cell, b, args.device)
        records.append(record)
        if g is not None and not cell.checkpointing and cell.advantage == "nonzero" and cell.backend == "default":
            grads[cell.key] = g
        if record["outcome"] == "non-finite" and first is None:
            first = (cell, probes(tr, cell, b))
        print(f"[{i + 1}/{len(cells)}] {cell.key}: {record['outcome']}"
              + (f" {record['nonfinite_modules'][:3]}" if record.get("nonfinite_modules") else ""), flush=True)
    comp = comparisons(grads, cells)
    outcomes = [r["outcome"] for r in records]
    summary = {"cells": len(records), "ran": sum(o in ("finite", "non-finite") for o in outcomes),
               **{o: outcomes.count(o) for o in sorted(set(outcomes))}, "seconds": round(time.perf_counter() - t0, 1)}
    print()
    print_table(records)
    print()
    print_comparison(comp)
    print(f"\nfirst non-finite cell: {first[0].key if first else None}"
          + (f"; anomaly op: {first[1]['anomaly']['op']}" if first else ""))
    import diffusers

    result = {"device": args.device, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "diffusers": diffusers.__version__, "quick": args.quick,
              "shape": {"batch": args.batch, "latent": [16, size, size], "image_tokens": size * size // 4,
                        "text_tokens": text_len, "steps": args.steps, "rank": args.rank, "alpha": args.alpha,
                        "lora_b_std": args.lora_b_std, "ff": args.ff},
              "summary": summary, "first_nonfinite": first[0].key if first else None,
              "probes": first[1] if first else None, "comparison": comp, "cells": records}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
