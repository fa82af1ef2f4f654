"""Throughput of the Qwen2-VL reward models (rewards/vlm_reward_models.py), called directly and through the reward
server, on a small random-init Qwen2-VL built here (no hub; a random head: the scores are noise, the cost is real).

    python scripts/bench_vlm_rewards.py                 # "small" Qwen2-VL, 8 samples per call, 10 s per arm
    python scripts/bench_vlm_rewards.py --quick         # "tiny" model, 4 samples, 2 s per arm

For each reward (hpsv3 on images --image-size px, resized to --pixels; video_align on --frames-frame videos,
--num-frames sampled, at most --pixels per frame), the same batch is scored back to back for --seconds per arm, in
--rounds alternating rounds: in-process (direct), and through an in-process RewardServer reached by RemoteReward over
loopback HTTP (served: adds the safetensors encoding, the HTTP round trip and the server's queue). Reports the median
samples/s of each arm and the ratio.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_base(path: str, size: str) -> str:
    """A random-init Qwen2-VL folder (real class, local tokenizer and processor) fitted to the reward prompts."""
    import torch

    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from rewards.vlm_reward_models import HPSV3_INSTRUCTION, VIDEOALIGN_PROMPT

    torch.manual_seed(0)
    tok = build_tokenizer([HPSV3_INSTRUCTION, VIDEOALIGN_PROMPT, "a red circle above two blue squares"])
    build_model("qwen2_vl", tok, size).save_pretrained(path)
    build_processor("qwen2_vl", tok).save_pretrained(path)
    return path


def rate(fn, n: int, seconds: float) -> float:
    """Samples per second of `fn()` (n samples a call) over >= `seconds` after one warm-up call."""
    fn()
    t0, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return calls * n / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="Qwen2-VL size (mmrl.models.qwen_vl)")
    p.add_argument("--batch", type=int, default=8, help="samples per call")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per arm")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--pixels", type=int, default=112 * 112, help="resized image / frame area")
    p.add_argument("--frames", type=int, default=16, help="frames of each generated video")
    p.add_argument("--num-frames", type=int, default=4, help="frames video_align samples")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per arm (median reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, 4 samples, 2 s per arm")
    args = p.parse_args(argv)
    import torch

    from mmrl.reward_server import RemoteReward, RewardServer
    from rewards.vlm_reward_models import HPSv3, VideoAlign

    if args.quick:
        args.size, args.batch, args.seconds, args.pixels = "tiny", 4, 2.0, 56 * 56
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    examples = [{"prompt": f"a red circle above {i} blue squares"} for i in range(args.batch)]
    s = args.image_size
    cases = {
        "hpsv3": (lambda path: HPSv3(path, pixels=args.pixels, batch_size=args.batch, random_head=True),
                  torch.rand(args.batch, 3, s, s, generator=g) * 2 - 1),
        "video_align": (lambda path: VideoAlign(path, num_frames=args.num_frames, max_frame_pixels=args.pixels,
                                                min_frame_pixels=min(args.pixels, 128 * 28 * 28),
                                                batch_size=args.batch, random_head=True),
                        torch.rand(args.batch, 3, args.frames, s, s, generator=g) * 2 - 1),
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_base(os.path.join(tmp, "qwen2-vl"), args.size)
        for name, (make, x) in cases.items():
            reward = make(path)
            srv = RewardServer(reward, name).start()
            try:
                client = RemoteReward(srv.url, timeout_s=120, retries=0)
                arms = {"direct": lambda: reward(x, examples), "served": lambda: client(x, examples)}
                rates = {k: [] for k in arms}
                for _ in range(args.rounds):  # alternating rounds: a busy machine slows both arms alike
                    for k, fn in arms.items():
                        rates[k].append(rate(fn, args.batch, args.seconds / args.rounds))
            finally:
                srv.close()
            direct, served = statistics.median(rates["direct"]), statistics.median(rates["served"])
            results[name] = {"direct_samples_per_s": round(direct, 2), "served_samples_per_s": round(served, 2),
                             "served_over_direct": round(served / direct, 3)}
            print(f"{name}: {results[name]}", flush=True)
    print(json.dumps({"size": args.size, "batch": args.batch, "image_size": s, "pixels": args.pixels,
                      "frames": args.frames, "num_frames": args.num_frames, "threads": args.threads,
                      "rounds": args.rounds,
                      "seconds": args.seconds, "device": "cpu", "results": results}))


if __name__ == "__main__":
    main()
