"""Throughput of the VLM judges (rewards/judges.py): samples/s of the pointwise UnifiedRewardScore called
directly and served (RewardServer in this process, reached over loopback HTTP by RemoteReward), and pairs/s
of the pairwise VLMJudge with the UnifiedReward-Think (Qwen3) prompt.

    python scripts/bench_judges.py                        # a small random-init Qwen2.5-VL, 16 images, 32 tokens
    python scripts/bench_judges.py --quick                # tiny model, 4 images, 8 tokens
    python scripts/bench_judges.py --model /path/UnifiedReward-qwen-7b --device cuda --dtype bfloat16

Without --model a random-init model of the real class is built in a temporary folder (no weights can be
downloaded here): it writes garbage until max_new_tokens, so every answer is unreadable (NaN, counted) and
every sample generates exactly --max-new-tokens tokens, which makes the timings comparable. The prompt is the
public UnifiedReward one; with the tiny local tokenizer it is far more tokens than with Qwen's. Times exclude
loading; the first call (warm-up) is not timed. The last line is one JSON object.
"""

import argparse
import json
import tempfile
import time


def build_model(path: str, size: str) -> str:
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from rewards import unified_reward_prompts as ur

    import torch

    torch.manual_seed(0)
    tok = build_tokenizer([ur.UR_POINT, ur.UR_THINK_QWEN3, "a red circle two blue squares"])
    build_model("qwen2_5_vl", tok, size).save_pretrained(path)
    build_processor("qwen2_5_vl", tok).save_pretrained(path)
    return path


def timed(fn, reps: int) -> float:
    """Seconds per call (the mean of reps calls after one untimed warm-up)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Qwen-VL folder (default: build a random-init one)")
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="size of the built model")
    p.add_argument("--n", type=int, default=16, help="images per reward call (pairs: n // 2)")
    p.add_argument("--batch-size", type=int, default=8, help="the judges' batch_size (turns per generate)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--resolution", type=int, default=56)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="tiny model, 4 images, 8 tokens, 1 rep")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.n, args.max_new_tokens, args.reps = "tiny", 4, 8, 1
    import torch

    from mmrl.reward_server import RemoteReward, RewardServer
    from rewards.judges import UnifiedRewardScore, VLMJudge

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    path = args.model or build_model(tmp.name, args.size)
    kw = dict(device=args.device, dtype=args.dtype, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    x = torch.rand(args.n, 3, args.resolution, args.resolution, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ex = [{"prompt": "a red circle" if i % 2 else "two blue squares"} for i in range(args.n)]

    reward = UnifiedRewardScore(path, **kw)
    reward.vlm.load()
    direct_s = timed(lambda: reward(x, ex), args.reps)
    srv = RewardServer(reward, "unified_reward", max_batch=max(256, args.n), max_wait_ms=1).start()
    try:
        client = RemoteReward(srv.url, timeout_s=600, retries=0)
        served_s = timed(lambda: client(x, ex), args.reps)
    finally:
        srv.close()
    judge = VLMJudge(path, style="unified_reward_think_qwen3", **kw)
    judge.vlm.load()
    half = max(1, args.n // 2)
    pair_s = timed(lambda: judge(x[:half], x[half:2 * half], ex[:half]), args.reps)
    prompt_tokens = reward.vlm.encode(reward.turns(x[:1], ex[:1]))["input_ids"].shape[1]
    res = {
        "model": args.model or f"random-init qwen2_5_vl {args.size}", "device": args.device, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "n": args.n, "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "resolution": args.resolution, "prompt_tokens": prompt_tokens,
        "pointwise_direct_samples_per_s": round(args.n / direct_s, 2),
        "pointwise_served_samples_per_s": round(args.n / served_s, 2),
        "served_overhead_ms_per_call": round(1000 * (served_s - direct_s), 1),
        "pairwise_think_pairs_per_s": round(half / pair_s, 2),
        "unparseable_total": reward.unparseable,  # over every call above: a random model writes garbage
    }
    print(f"pointwise: {res['pointwise_direct_samples_per_s']} samples/s direct, "
          f"{res['pointwise_served_samples_per_s']} served; "
          f"pairwise (Think): {res['pairwise_think_pairs_per_s']} pairs/s")
    print(json.dumps(res))
    tmp.cleanup()


if __name__ == "__main__":
    main()
