"""train.compile (regional compilation of the repeated transformer blocks, mmrl/compiled.py) against eager, on the
calls a flow recipe makes, side by side on the same inputs and weights:

- sampling: the CFG-guided velocity without gradients (one rollout step of --rows rows, x2 with CFG);
- training: the CFG-guided velocity with gradients (sampler.cfg_grad=cond) and its backward, --rows transitions.

Reported: seconds per call (median of --repeats after one warm-up call; wall and this process's CPU time, the
steadier figure on a shared machine), the compile time (the first compiled call
of each kind minus an eager call: what a run pays once per shape; inductor's on-disk cache starts empty unless
--warm-cache), the speed-up eager / compiled, and the largest
absolute differences of the velocity and of the gradients (relative to the gradients' scale). Model: an
SD3Transformer2DModel of ~100 M parameters (7 layers, 10 heads x 64; --layers, --heads) at a 32 x 32 latent, CFG 4.5.
Backend: inductor (the default of torch.compile; on CPU it compiles C++ with the system's g++).

    python benchmarks/bench_compile.py            # ~100 M parameters, minutes on 1 CPU thread (compiling included)
    python benchmarks/bench_compile.py --quick    # a small model, 2 repeats
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def build(layers: int, heads: int, size: int, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    from mmrl.models.flow_model import FlowModel

    torch.manual_seed(seed)
    tr = SD3Transformer2DModel(sample_size=size, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=64,
                               num_attention_heads=heads, joint_attention_dim=256, caption_projection_dim=64 * heads,
                               pooled_projection_dim=128, out_channels=16, pos_embed_max_size=size)
    return FlowModel(transformer=tr, encode_prompts=None, decode=lambda x: x, latent_shape=(16, size, size),
                     cfg_grad="cond")


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, this process's CPU seconds, fn()): on a shared machine the CPU time is the steadier figure."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 2-layer, 2-head model at a 16 x 16 latent, 2 repeats")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--heads", type=int, default=10)
    p.add_argument("--size", type=int, default=32, help="latent height = width")
    p.add_argument("--rows", type=int, default=4, help="rows per call (x2 with CFG)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warm-cache", action="store_true",
                   help="use inductor's on-disk cache (default: a fresh one, so compile_s is a first run's)")
    a = p.parse_args()
    if not a.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_")
    if a.quick:
        a.layers, a.heads, a.size, a.repeats = 2, 2, 16, 2
    torch.set_num_threads(a.threads)

    from mmrl.compiled import compile_blocks

    model = build(a.layers, a.heads, a.size)
    params = list(model.transformer.parameters())
    g = torch.Generator().manual_seed(1)
    n, w = a.rows, 4.5
    x = torch.randn(n, 16, a.size, a.size, generator=g)
    sigma = torch.rand(n, generator=g) * 0.9 + 0.05
    enc, pooled = torch.randn(n, 77, 256, generator=g), torch.randn(n, 128, generator=g)
    neg = (torch.randn(1, 77, 256, generator=g).expand(n, -1, -1), torch.randn(1, 128, generator=g).expand(n, -1))
    probe = torch.randn(n, 16, a.size, a.size, generator=g)

    def sampling():
        with torch.no_grad():
            return model.velocity(x, sigma, enc, pooled, w, neg)

    def training():
        for q in params:
            q.grad = None
        (model.velocity(x, sigma, enc, pooled, w, neg) * probe).sum().backward()
        return [q.grad.clone() for q in params]

    calls = {"sampling": sampling, "training": training}
    res = {"eager": {}, "compiled": {}, "eager_cpu": {}, "compiled_cpu": {}, "compile_s": {}}
    first = {}
    for name, fn in calls.items():
        times = [timed(fn) for _ in range(a.repeats + 1)]  # the first call warms up
        res["eager"][name] = statistics.median(t for t, _, _ in times[1:])
        res["eager_cpu"][name] = statistics.median(c for _, c, _ in times[1:])
        first[name] = times[-1][2]
    t0 = time.perf_counter()
    compile_blocks([model.transformer], torch.device("cpu"))
    setup = time.perf_counter() - t0
    outs = {}
    for name, fn in calls.items():
        t_first, _, _ = timed(fn)  # compiles this call's graphs (forward; with gradients also the backward)
        res["compile_s"][name] = t_first - res["eager"][name]
        times = [timed(fn) for _ in range(a.repeats)]
        res["compiled"][name] = statistics.median(t for t, _, _ in times)
        res["compiled_cpu"][name] = statistics.median(c for _, c, _ in times)
        outs[name] = times[-1][2]
    v_diff = float((outs["sampling"] - first["sampling"]).abs().max())
    scale = max(float(q.abs().max()) for q in first["training"])
    g_diff = max(float((u - v).abs().max()) for u, v in zip(first["training"], outs["training"]))
    out = {"params_m": sum(q.numel() for q in params) / 1e6, "layers": a.layers, "latent": a.size, "rows": n,
           "cfg_scale": w, "threads": a.threads, "torch": torch.__version__, "backend": "inductor", **res,
           "speedup": {k: res["eager"][k] / res["compiled"][k] for k in calls},
           "speedup_cpu": {k: res["eager_cpu"][k] / res["compiled_cpu"][k] for k in calls}, "compile_setup_s": setup,
           "max_abs_velocity_diff": v_diff, "max_abs_grad_diff": g_diff, "grad_scale": scale}
    print(f"{out['params_m']:.0f} M parameters, {n} rows (x2 with CFG {w}), {a.threads} thread(s): "
          + "; ".join(f"{k} eager {res['eager'][k]:.3f} s, compiled {res['compiled'][k]:.3f} s "
                      f"({out['speedup'][k]:.2f}x; CPU time {out['speedup_cpu'][k]:.2f}x), "
                      f"compile {res['compile_s'][k]:.0f} s"
                      for k in calls)
          + f"; max |dv| {v_diff:.1e}, max |dgrad| {g_diff:.1e} (scale {scale:.1e})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
