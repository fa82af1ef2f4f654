"""Peak memory of a rollout and of a training pass, whole vs `train.micro_batch`, side by side on the same
rollout, with the gradient difference between the two (it must be rounding only):

- flow: the shapes world's SD3Transformer2DModel (tasks/assets/shapes-base), the main job's sampler;
- token: a small Qwen2.5-VL (real class, random init) on the embedded grounding world's mp4 videos.

    python benchmarks/bench_memory.py               # flow 8 prompts x 8, token 4 prompts x 8
    python benchmarks/bench_memory.py --quick       # flow 2 x 8, token 2 x 4

Each configuration runs in a fresh process (mmrl/testing/memory.py): peak = the memory a phase added at its peak. Training runs one minibatch (one optimizer step, whose gradient is
kept and compared). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def compare(name: str, config: str, overrides: list[str], micro: int, threads: int, tmp: str) -> dict:
    import torch

    from mmrl.testing.memory import measure

    res = {}
    for m in (0, micro):
        res[m] = measure(config, [*overrides, f"train.micro_batch={m}", "train.minibatches=1", f"log.out_dir={tmp}/{name}",
                                  "log.tensorboard=false", "log.progress=false"], threads,
                         os.path.join(tmp, f"{name}-{m}.pt"), resample_whole=name == "token")
    g0, g1 = (torch.load(os.path.join(tmp, f"{name}-{m}.pt")) for m in (0, micro))
    diff = max((a - b).abs().max().item() for a, b in zip(g0, g1))
    scale = max(a.abs().max().item() for a in g0)
    return {"micro_batch": micro, **{f"whole_{k}": v for k, v in res[0].items()},
            **{f"micro_{k}": v for k, v in res[micro].items() if k.endswith("mib")},
            "train_peak_ratio": res[micro]["train_peak_mib"] / max(res[0]["train_peak_mib"], 1e-9),
            "sample_peak_ratio": res[micro]["sample_peak_mib"] / max(res[0]["sample_peak_mib"], 1e-9),
            "grad_max_abs_diff": diff, "grad_max_abs": scale}


def token_model(tmp: str) -> tuple[str, str]:
    """A small Qwen2.5-VL folder and a grounding world (mp4 videos), built here (no hub)."""
    import torch

    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from tasks.grounding_world import ANSWER, PROMPT, build_world

    torch.manual_seed(0)
    tok = build_tokenizer([PROMPT, ANSWER, "red green blue yellow circle square triangle appears shown visible"])
    path = os.path.join(tmp, "small-qwen2_5_vl")
    build_model("qwen2_5_vl", tok, "small").save_pretrained(path)
    build_processor("qwen2_5_vl", tok).save_pretrained(path)
    world = os.path.join(tmp, "world")
    build_world(world, {"train": 8, "test": 2})
    return path, world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller rollouts (a minute or two)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    b_flow, b_tok, g_tok = (2, 2, 4) if args.quick else (8, 4, 8)
    with tempfile.TemporaryDirectory() as tmp:
        flow = compare("flow", "configs/t2i/shapes_grpo.yaml",
                       [f"train.prompts_per_iter={b_flow}", "sampler.sde_window_size=0", "task.eval_prompts=6"],
                       8, args.threads, tmp)
        path, world = token_model(tmp)
        token = compare("token", "configs/tiny/vlm_smoke.yaml",
                        [f"model.path={path}", f"task.kwargs.root={world}", "task.kwargs.train_videos=8",
                         "task.kwargs.test_videos=2", f"train.prompts_per_iter={b_tok}", f"train.group_size={g_tok}",
                         "sampler.max_new_tokens=16", "model.shared_prefix=false"], g_tok, args.threads, tmp)
    for name, r in (("flow (shapes SD3, transitions)", flow), ("token (small Qwen2.5-VL, sequences)", token)):
        print(f"{name}: micro_batch={r['micro_batch']}  train peak {r['whole_train_peak_mib']:.1f} -> "
              f"{r['micro_train_peak_mib']:.1f} MiB (x{r['train_peak_ratio']:.2f}), rollout peak "
              f"{r['whole_sample_peak_mib']:.1f} -> {r['micro_sample_peak_mib']:.1f} MiB (x{r['sample_peak_ratio']:.2f}), "
              f"grad max |diff| {r['grad_max_abs_diff']:.2e} of max |grad| {r['grad_max_abs']:.2e}")
    print(json.dumps({"flow": flow, "token": token}))


if __name__ == "__main__":
    main()
