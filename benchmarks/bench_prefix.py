"""Shared-prefix scoring vs the naive forward: one group of G completions under one long video prompt.

The token policy's scoring pass (`TokenPolicy.log_prob`, the training forward) either runs the full
[prompt | completion] sequence G times (naive, `model.shared_prefix=false`) or runs the prompt with its video
once and indexes its KV cache out to the G rows (shared, the default). This times forward + backward of the
summed log-probs for both on the same small Qwen2.5-VL (real class, random init), reports the peak memory of
each (CUDA: max_memory_allocated; CPU: a child process per mode, its peak RSS during the timed steps above its
RSS before them) and checks that log-probs and every gradient agree.

--checkpointing: both modes under gradient checkpointing (the shared prompt recomputed once in backward, not once
per row); --ddp N: each mode on N processes under DDP (gloo on CPU, one group of G rows per rank, the gradients
all-reduced; the peak is the largest rank's). Under either, the gradients of the two modes (rank 0's, after the
all-reduce) are compared too.

    python benchmarks/bench_prefix.py            # G 8, 64 frames of 168x168 (1,152 video tokens), 64-token completions
    python benchmarks/bench_prefix.py --quick    # G 4, 16 frames (288 video tokens), 16-token completions
    python benchmarks/bench_prefix.py --quick --ddp 2 --checkpointing

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPT = "When does the red circle appear?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=8, help="G: completions sharing the prompt")
    p.add_argument("--frames", type=int, default=64, help="video frames (2 per temporal token)")
    p.add_argument("--side", type=int, default=168, help="frame side in pixels (28 px per merged token)")
    p.add_argument("--length", type=int, default=64, help="completion tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per mode (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--checkpointing", action="store_true", help="both modes under gradient checkpointing")
    p.add_argument("--ddp", type=int, default=1, help="processes per mode (DDP, gloo on CPU)")
    p.add_argument("--mode", choices=["naive", "shared"], help=argparse.SUPPRESS)  # child process: one mode
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.group, args.frames, args.length, args.repeats = 4, 16, 16, 2
    return args


def build(folder: str, args) -> str:
    """Model folder + an mp4 of random frames under folder; returns the video path."""
    import numpy as np
    import torch

    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from tasks.grounding_world import write_mp4

    torch.manual_seed(0)
    tok = build_tokenizer([PROMPT, "<answer>2 to 5</answer>"])
    build_model("qwen2_5_vl", tok, "small").save_pretrained(folder)
    build_processor("qwen2_5_vl", tok, frame_pixels=args.side * args.side).save_pretrained(folder)
    frames = np.random.default_rng(0).integers(0, 255, (args.frames, args.side, args.side, 3), dtype=np.uint8)
    write_mp4(os.path.join(folder, "clip.mp4"), frames)
    return os.path.join(folder, "clip.mp4")


def policy_and_rollout(folder: str, args, seed: int = 0):
    import torch

    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.data import Rollout, group_ids
    from mmrl.policy.token import TokenPolicy, load_token_model
    from mmrl.video import VideoOptions

    model, proc = load_token_model(folder)
    px = args.side * args.side
    pol = TokenPolicy(model=model, processor=proc, sampler_cfg=SamplerConfig(temperature=1.0, max_new_tokens=args.length),
                      lora_cfg=LoraConfig(), video=VideoOptions(nframes=args.frames, min_pixels=px, max_pixels=px),
                      freeze_vision=False,
                      reference="none")
    ex = {"prompt": PROMPT, "video": os.path.join(folder, "clip.mp4")}
    prompt_len = pol.encode_prompt(ex)["input_ids"].shape[1]
    if args.checkpointing:
        pol.enable_gradient_checkpointing()
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(len(pol.tokenizer))) - set(pol.suppress_ids) - {pol.eos_id}))
    ids = allowed[torch.randint(0, len(allowed), (args.group, args.length), generator=g)]  # full length, no EOS
    ro = Rollout(group_id=group_ids(1, args.group), old_log_prob=torch.zeros(ids.shape),
                 action_mask=torch.ones(ids.shape, dtype=torch.bool), examples=[ex] * args.group,
                 outputs=[""] * args.group, extras={"completion_ids": ids})
    return pol, ro, prompt_len


def step(pol, ro, shared: bool):
    """Forward + backward of the summed log-probs; returns (log-probs, {name: grad})."""
    import torch

    pol.shared_prefix = shared
    pol.model.zero_grad(set_to_none=True)
    lp = pol.log_prob(ro, torch.arange(len(ro))).log_prob
    lp.sum().backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in pol.model.named_parameters() if p.grad is not None}


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_mode(args) -> dict:
    """One mode in this process (one rank of it under --ddp): times, and peak memory (CUDA allocator, or the peak
    RSS sampled every 2 ms during the timed steps, above the RSS before them). Rank 0 saves the warm-up step's
    gradients (all-reduced under DDP) beside the model."""
    import threading

    import torch

    torch.set_num_threads(args.threads)
    dist = None
    if args.ddp > 1:
        from mmrl.parallel.distributed import Distributed

        dist = Distributed("ddp")
    rank = dist.rank if dist is not None else 0
    pol, ro, _ = policy_and_rollout(args.model_dir, args, seed=rank)  # each rank its own completions
    if dist is not None:
        pol.parallelize(dist.wrap, "ddp")
    shared = args.mode == "shared"
    _, grads = step(pol, ro, shared)  # warm-up (video decoded and cached here)
    if rank == 0:
        torch.save(grads, os.path.join(args.model_dir, f"grads-{args.mode}.pt"))
    pol.model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base, peak, running = rss_bytes(), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step(pol, ro, shared)
        times.append(time.perf_counter() - t0)
    running[0] = False
    watcher.join()
    used = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else peak[0] - base
    if dist is not None:  # the largest rank's peak, rank 0's times (each step ends in the all-reduce)
        used = max(dist.gather_list([used], every_rank=True))
        dist.close()
    return {"seconds": statistics.median(times), "peak_bytes": used}


def main(argv=None):
    args = parse_args(argv)
    if args.mode:
        res = run_mode(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(res))
        return
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        build(d, args)
        pol, ro, prompt_len = policy_and_rollout(d, args)
        lp_naive, g_naive = step(pol, ro, shared=False)
        lp_shared, g_shared = step(pol, ro, shared=True)
        grad_diff = max((g_shared[n] - g_naive[n]).abs().max().item() for n in g_naive)
        grad_scale = max(g.abs().max().item() for g in g_naive.values())
        # the same comparison in float64: the gap shrinks by orders of magnitude, so the float32 gap is rounding
        # (not all of it goes: Qwen's RMSNorm computes in float32 whatever the weights' dtype)
        pol.model.double()
        _, g64_naive = step(pol, ro, shared=False)
        _, g64_shared = step(pol, ro, shared=True)
        grad_diff64 = max((g64_shared[n] - g64_naive[n]).abs().max().item() for n in g64_naive)
        assert g_naive.keys() == g_shared.keys(), "the two modes reached different parameters"
        del pol, ro
        res = {}
        launch = [sys.executable] if args.ddp == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ddp}"]
        env = {**os.environ, "PYTHONPATH": ROOT, **({"ACCELERATE_USE_CPU": "true"} if args.ddp > 1 else {})}
        for mode in ("naive", "shared"):  # a child process (or DDP run) each, so each peak RSS is its own
            cmd = [*launch, os.path.abspath(__file__), "--mode", mode, "--model-dir", d, "--ddp", str(args.ddp),
                   "--group", str(args.group), "--frames", str(args.frames), "--side", str(args.side),
                   "--length", str(args.length), "--repeats", str(args.repeats),
                   "--threads", str(max(1, args.threads // args.ddp)), *(["--checkpointing"] if args.checkpointing else [])]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if run.returncode:
                raise RuntimeError(f"{mode} failed:\n{run.stderr[-3000:]}")
            res[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        g_runs = {mode: torch.load(os.path.join(d, f"grads-{mode}.pt")) for mode in ("naive", "shared")}
        run_grad_diff = max((g_runs["shared"][n] - g_runs["naive"][n]).abs().max().item() for n in g_runs["naive"])
    print(json.dumps({
        "model": "Qwen2_5_VLForConditionalGeneration (small)", "group": args.group, "prompt_tokens": prompt_len,
        "completion_tokens": args.length, "threads": args.threads, "processes": args.ddp,
        "threads_per_process": max(1, args.threads // args.ddp),
        "parallel": "ddp" if args.ddp > 1 else "none", "gradient_checkpointing": args.checkpointing,
        "naive_s": round(res["naive"]["seconds"], 3), "shared_s": round(res["shared"]["seconds"], 3),
        "time_ratio_shared_over_naive": round(res["shared"]["seconds"] / res["naive"]["seconds"], 3),
        "naive_peak_mib": round(res["naive"]["peak_bytes"] / 2**20, 1),
        "shared_peak_mib": round(res["shared"]["peak_bytes"] / 2**20, 1),
        "max_abs_logprob_diff": float((lp_shared - lp_naive).abs().max()), "max_abs_grad_diff": grad_diff,
        "max_abs_grad": grad_scale, "max_abs_grad_diff_float64": grad_diff64,
        "max_abs_grad_diff_timed_runs": run_grad_diff,
        "peak_memory": "cuda max_memory_allocated" if torch.cuda.is_available() else "cpu peak RSS during the steps above the RSS before them"}))


if __name__ == "__main__":
    main()
