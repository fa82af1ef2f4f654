"""The training forward + backward of a CFG recipe with sampler.cfg_grad=cond (Flow-GRPO's gradient w dv_c), two ways,
side by side on the same inputs and weights:

- batched (mmrl before): one forward of the [uncond | cond] rows with autograd, v_u detached after it: autograd
  stores the activations of both halves and the backward runs through the whole doubled batch;
- no-grad (FlowModel.velocity now): the unconditional half runs under torch.no_grad(), only the conditional half is
  recorded and backpropagated.

Reported: seconds per training pass (median of --repeats), bytes autograd saves for backward (the activation memory of
a pass, counted by saved-tensor hooks, the weights themselves left out), the ratios new / old, and the largest
relative difference of the two gradients. Model: an SD3Transformer2DModel of 174 M parameters (12 layers, 10 heads
x 64; --layers, --heads) at a 32 x 32 latent, CFG 4.5, a micro-batch of --rows transitions.

    python benchmarks/bench_cfg_grad.py            # 174 M parameters, ~4 min on 1 CPU thread
    python benchmarks/bench_cfg_grad.py --quick    # a small model, seconds
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(layers: int, heads: int, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    from mmrl.models.flow_model import FlowModel

    torch.manual_seed(seed)
    tr = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=64,
                               num_attention_heads=heads, joint_attention_dim=256, caption_projection_dim=64 * heads,
                               pooled_projection_dim=128, out_channels=16, pos_embed_max_size=32)
    return FlowModel(transformer=tr, encode_prompts=None, decode=lambda x: x, latent_shape=(16, 32, 32),
                     cfg_grad="cond")


def batched_velocity(model, x, sigma, enc, pooled, neg, w):
    """mmrl's CFG velocity before: one batched forward, the unconditional half detached."""
    v = model._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([neg[0], enc]), torch.cat([neg[1], pooled]))
    v_u, v_c = v.chunk(2)
    v_u = v_u.detach()
    return v_u + w * (v_c - v_u)


def one_pass(fn, params, probe) -> tuple[float, int, list[torch.Tensor]]:
    """(seconds, bytes saved for backward, gradients) of loss = <fn(), probe> and its backward. Saved tensors that
    are the weights themselves (matmuls keep a reference to them) hold no memory of their own and are not counted."""
    saved, weights = [0], {q.untyped_storage().data_ptr() for q in params}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[0] += t.numel() * t.element_size()
        return t

    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (fn() * probe).sum()
    loss.backward()
    return time.perf_counter() - t0, saved[0], [p.grad.clone() for p in params]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 2-layer model, 2 repeats")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=10)
    p.add_argument("--rows", type=int, default=4, help="transitions per training forward (x2 rows with CFG)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.quick:
        a.layers, a.heads, a.repeats = 2, 2, 2
    torch.set_num_threads(a.threads)
    model = build(a.layers, a.heads)
    params = list(model.transformer.parameters())
    g = torch.Generator().manual_seed(1)
    n, w = a.rows, 4.5
    x = torch.randn(n, 16, 32, 32, generator=g)
    sigma = torch.rand(n, generator=g) * 0.9 + 0.05
    enc, pooled = torch.randn(n, 77, 256, generator=g), torch.randn(n, 128, generator=g)
    neg = (torch.randn(1, 77, 256, generator=g).expand(n, -1, -1), torch.randn(1, 128, generator=g).expand(n, -1))
    probe = torch.randn(n, 16, 32, 32, generator=g)
    arms = {"batched": lambda: batched_velocity(model, x, sigma, enc, pooled, neg, w),
            "no_grad": lambda: model.velocity(x, sigma, enc, pooled, w, neg)}
    runs = {k: [] for k in arms}
    for _ in range(a.repeats + 1):  # the first round warms up; rounds alternate the arms
        for name, fn in arms.items():
            runs[name].append(one_pass(fn, params, probe))
    res = {name: {"seconds": statistics.median(r[0] for r in rs[1:]), "saved_mib": rs[-1][1] / 2**20}
           for name, rs in runs.items()}
    g_old, g_new = runs["batched"][-1][2], runs["no_grad"][-1][2]
    rel = max(float((a_ - b_).abs().max() / a_.abs().max().clamp(min=1e-30)) for a_, b_ in zip(g_old, g_new))
    out = {"params_m": sum(q.numel() for q in params) / 1e6, "rows": n, "cfg_scale": w, "threads": a.threads, **res,
           "time_ratio": res["no_grad"]["seconds"] / res["batched"]["seconds"],
           "saved_ratio": res["no_grad"]["saved_mib"] / res["batched"]["saved_mib"], "max_rel_grad_diff": rel}
    print(f"{out['params_m']:.0f} M parameters, {n} transitions (x2 with CFG {w}): "
          f"batched {res['batched']['seconds']:.2f} s, {res['batched']['saved_mib']:.0f} MiB saved; "
          f"no-grad {res['no_grad']['seconds']:.2f} s, {res['no_grad']['saved_mib']:.0f} MiB saved; "
          f"time {out['time_ratio']:.2f}x, activations {out['saved_ratio']:.2f}x, max rel gradient diff {rel:.1e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
