"""The cost of the T5 prompt length (model.text_max_length) in one training iteration of a small SD3 pipeline: the
same iteration (sampling with CFG, old log-probs, one optimizer step) at the pipeline's 256 tokens and at Flow-GRPO's
128, side by side in one process, best of `--repeats`.

    python scripts/bench_text_length.py [--quick] [--repeats R]

Prints one line per length and one JSON object on the last line: {"seconds": {"256": s, "128": s}, "speedup": x}.
"""

import argparse
import json
import os
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 prompts x 2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    from mmrl.compose import load_config
    from mmrl.models.tiny_pipelines import build_tiny
    from mmrl.reward import REWARDS
    from mmrl.trainer import Trainer

    REWARDS.register("mean_value")(lambda outputs, examples: outputs.float().mean((1, 2, 3)))  # any image reward

    torch.set_num_threads(max(1, os.cpu_count() // 2))
    repeats, batch = (1, ["train.prompts_per_iter=2", "train.group_size=2"]) if args.quick else \
        (args.repeats, ["train.prompts_per_iter=4", "train.group_size=4"])
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny("sd3").save_pretrained(os.path.join(tmp, "sd3"))
        prompts = os.path.join(tmp, "prompts.txt")
        open(prompts, "w").write("a red circle\ntwo blue squares\na green triangle above a cat\n")
        seconds = {}
        for length in (256, 128):
            tr = Trainer(load_config(None, [
                f"model.path={tmp}/sd3", f"model.text_max_length={length}", "task.name=prompt_file",
                f"task.prompt_file={prompts}", "reward.name=mean_value", "reward.kwargs={}", "sampler.num_steps=6",
                "sampler.cfg_scale=4.5", "model.sample_size=8", f"log.out_dir={tmp}/run{length}",
                "log.tensorboard=false", "log.progress=false", *batch]))
            best = float("inf")
            for it in range(repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                tr.step(it)
                best = min(best, time.perf_counter() - t0) if it else best
            seconds[str(length)] = round(best, 3)
            print(f"T5 tokens {length}: {best:.3f} s per iteration")
    print(json.dumps({"seconds": seconds, "speedup": round(seconds["256"] / seconds["128"], 3)}))


if __name__ == "__main__":
    main()
