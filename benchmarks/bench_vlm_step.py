"""Time per GRPO step: mmrl's trainer vs TRL's GRPOTrainer on the same small Qwen2.5-VL with image inputs.

Both start from the same saved model folder (a random-init Qwen2_5_VLForConditionalGeneration built locally,
no hub), get the same prompts and images (--image-size, default 224x224: 64 visual tokens), the same group
size G, prompts per step P (P * G completions), completion length L, sampling temperature, learning rate and
reward (shorter is better, TRL's example reward), one optimizer step per generation round and no KL term. A
step = generation + reward + log-probs + forward/backward + optimizer step. Runs alternate (TRL, mmrl) in one
process; the first step of each is a warm-up and is not counted.

Where the time goes: decoding costs both frameworks the same per-token forwards; mmrl saves on the prompt
(each prompt and its image run once per group, in sampling and in scoring). So the ratio falls as the image
grows: with 56x56 images (4 visual tokens) decoding is most of a step and the ratio is near 0.7.

    python benchmarks/bench_vlm_step.py            # P 4, G 8, L 32, 224 px, 4 timed steps each
    python benchmarks/bench_vlm_step.py --image-size 56
    python benchmarks/bench_vlm_step.py --quick    # P 2, G 4, L 16, 2 timed steps each

The last line is one JSON object: median seconds per step for each, and the ratio mmrl / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = "What is shown in this image?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4, help="P: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--length", type=int, default=32, help="L: max completion tokens")
    p.add_argument("--steps", type=int, default=4, help="timed steps per framework (after one warm-up)")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--image-size", type=int, default=224,
                   help="image side in pixels (56: 4 visual tokens; 224: 64; 448: 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.group, args.length, args.steps = 2, 4, 16, 2
    return args


def build_model_folder(path: str, size: str, image_size: int) -> None:
    import torch

    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer([PROMPT, "a red circle on gray", "a blue square"])
    build_model("qwen2_5_vl", tok, size).save_pretrained(path)
    build_processor("qwen2_5_vl", tok, frame_pixels=image_size * image_size).save_pretrained(path)


def images(n: int, size: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def length_reward(completions, **_):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [-len(t) / 100.0 for t in texts]


def run_trl(model_dir: str, args, imgs) -> tuple[list[float], float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    n = args.prompts * (args.steps + 1)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * n, "image": imgs[:n]})
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    proc = AutoProcessor.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, use_cpu=True, max_steps=args.steps + 1, seed=0, report_to="none",
                         per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                         max_completion_length=args.length, temperature=1.0, learning_rate=1e-4, beta=0.0,
                         logging_steps=1, save_strategy="no", bf16=False, dataloader_num_workers=0,
                         gradient_checkpointing=False)  # TRL turns it on by default; mmrl does not use it
        torch.manual_seed(0)
        GRPOTrainer(model=model, reward_funcs=length_reward, args=cfg, train_dataset=ds, processing_class=proc,
                    callbacks=[Clock()]).train()
    return times[1:], statistics.mean(lengths) if lengths else float("nan")


def run_mmrl(model_dir: str, args, imgs) -> tuple[list[float], float]:
    import torch

    from mmrl.compose import load_config
    from mmrl.reward import REWARDS
    from mmrl.task import TASKS
    from mmrl.trainer import Trainer

    class ImageTask:
        def __init__(self, cfg):
            self.examples = [{"prompt": PROMPT, "image": im} for im in imgs]

        def sample(self, n, rng):
            return [self.examples[rng.randrange(len(self.examples))] for _ in range(n)]

        def eval_examples(self):
            return self.examples[:1]

    def reward(**_):
        return lambda outputs, examples: {"overall": torch.tensor(length_reward(outputs))}

    if "bench_images" not in TASKS:
        TASKS.register("bench_images")(ImageTask)
        REWARDS.register("bench_length")(reward)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            "model.policy=token", f"model.path={model_dir}", "model.reference=none", "model.freeze_vision=false",
            "sampler.temperature=1.0", f"sampler.max_new_tokens={args.length}", "task.name=bench_images",
            "reward.name=bench_length", f"train.prompts_per_iter={args.prompts}", f"train.group_size={args.group}",
            "train.minibatches=1", "train.lr=1e-4", f"train.threads={args.threads}", "algo.clip_range=0.2",
            f"log.out_dir={out}", "log.tensorboard=false", "log.progress=false", "log.image_every=0",
            "log.save_every=100000"])
        trainer = Trainer(cfg)
        times, lengths = [], []
        for it in range(args.steps + 1):
            t0 = time.perf_counter()
            m = trainer.step(it)
            times.append(time.perf_counter() - t0)
            lengths.append(m["rollout/actions_mean"])
        trainer.logger.close()
    return times[1:], statistics.mean(lengths[1:])


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        build_model_folder(d, args.size, args.image_size)
        imgs = images(args.prompts * (args.steps + 1), args.image_size)
        trl_times, trl_len = run_trl(d, args, imgs)
        mmrl_times, mmrl_len = run_mmrl(d, args, imgs)
    trl_s, mmrl_s = statistics.median(trl_times), statistics.median(mmrl_times)
    res = {"model": f"Qwen2_5_VLForConditionalGeneration ({args.size})", "prompts": args.prompts,
           "group": args.group, "max_completion": args.length, "image_size": args.image_size,
           "threads": args.threads,
           "trl_s_per_step": round(trl_s, 3), "mmrl_s_per_step": round(mmrl_s, 3),
           "ratio_mmrl_over_trl": round(mmrl_s / trl_s, 3), "trl_steps": [round(t, 3) for t in trl_times],
           "mmrl_steps": [round(t, 3) for t in mmrl_times], "trl_mean_completion": round(trl_len, 1),
           "mmrl_mean_completion": round(mmrl_len, 1)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
