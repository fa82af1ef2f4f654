"""Make the SFT base of the embedded grounding world: a small Qwen2.5-VL (the real transformers class, random
init, tokenizer and processor built locally) fine-tuned on the world's training queries to answer
`<think></think><answer>S to E</answer>`.

    python scripts/sft_grounding.py --minutes 10 --out runs/grounding-sft          # the SFT base
    python scripts/sft_grounding.py --minutes 5 --init runs/grounding-sft --out runs/grounding-control
                                                                                    # equal-time SFT control

The world (mp4 files + Charades-STA annotations) is built under --world on first use. The loss is the
mean token NLL of the reference answer computed by the token policy itself (`TokenPolicy.log_prob`), so SFT
and GRPO see exactly the same inputs. Every --eval-every minutes the model is scored on held-out videos
(greedy; mIoU, R1@m) and saved atomically as a transformers folder (model + processor) that
`mmrl train` (model.policy=token) and scripts/bench_grounding.py load with from_pretrained.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


from mmrl.checkpoint import atomic_dir
from mmrl.config import LoraConfig, SamplerConfig
from mmrl.data import Rollout
from mmrl.policy.vlm import TokenPolicy, load_token_model
from mmrl.rollout.engine import completion_mask
from mmrl.video import VideoOptions

VIDEO = VideoOptions(fps=2.0, min_pixels=56 * 56, max_pixels=56 * 56)  # 16 frames x 2 x 2 tokens = 32 video tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/grounding-sft")
    p.add_argument("--world", default="runs/grounding_world", help="where the synthetic world is built")
    p.add_argument("--train-videos", type=int, default=None, help="default: an existing world's, else 600")
    p.add_argument("--test-videos", type=int, default=None, help="default: an existing world's, else 220")
    p.add_argument("--ood", action="store_true", help="the out-of-distribution world (tasks/grounding_world.py: "
                   "held-out = id + long / novel / crowded splits); use its own --world folder")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--size", default="small", choices=["small", "tiny"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=5.0, help="minutes between evals/saves")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--init", default=None, help="continue from a saved model folder (fresh optimizer): the control")
    return p.parse_args(argv)


def build_base(size: str, world_examples: list[dict], answer_template: str):
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer

    corpus = [ex["prompt"] for ex in world_examples] + [answer_template.format(start=s, end=e)
                                                        for s in range(9) for e in range(9)]
    tok = build_tokenizer(corpus)
    return build_model("qwen2_5_vl", tok, size), build_processor("qwen2_5_vl", tok)


def nll(policy: TokenPolicy, examples: list[dict], answers: list[str]) -> torch.Tensor:
    """Mean token NLL of `answers` (+ EOS) given the examples' prompts."""
    tok = policy.tokenizer
    seqs = [tok(a, add_special_tokens=False).input_ids + [policy.eos_id] for a in answers]
    ids = torch.full((len(seqs), max(map(len, seqs))), policy.pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    mask = completion_mask(ids, policy.eos_id)
    ro = Rollout(group_id=torch.arange(len(seqs)), old_log_prob=torch.zeros(ids.shape), action_mask=mask,
                 examples=examples, outputs=answers, extras={"completion_ids": ids})
    logp = policy.log_prob(ro, torch.arange(len(seqs))).log_prob
    m = mask.to(logp.device, logp.dtype)
    return -(logp * m).sum() / m.sum()


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from mmrl.config import TaskConfig
    from tasks.grounding import GroundingWorldTask
    from tasks import grounding as grounding_eval

    task = GroundingWorldTask(TaskConfig(eval_prompts=args.eval_n), root=args.world,
                              train_videos=args.train_videos, test_videos=args.test_videos, ood=args.ood)
    if args.init:
        model, processor = load_token_model(args.init)
        print(f"initialized from {args.init}")
    else:
        model, processor = build_base(args.size, task.train, task.answer_template)
    policy = TokenPolicy(model, processor, SamplerConfig(temperature=1.0, max_new_tokens=16), LoraConfig(),
                         VIDEO, freeze_vision=False, reference="none")
    params = policy.trainable_parameters()
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params; "
          f"{len(task.train)} train / {len(task.eval)} held-out queries")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    log = open(args.out.rstrip("/") + ".log.jsonl", "a")
    t0, last_eval, step = time.time(), time.time(), 0
    while True:
        batch = task.sample(args.batch, rng)
        loss = nll(policy, batch, [task.reference_output(ex) for ex in batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        left = 1 - (time.time() - t0) / (args.minutes * 60)
        for g in opt.param_groups:  # warm-up, constant, linear cool-down over the last 20% of the budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 100, max(left, 0.0) / 0.2)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min", flush=True)
        done = left <= 0
        if done or time.time() - last_eval >= args.eval_every * 60:
            with atomic_dir(args.out) as tmp:
                model.save_pretrained(tmp)
                processor.save_pretrained(tmp)
                with open(os.path.join(tmp, "sft_info.json"), "w") as f:
                    json.dump({"step": step, "minutes": round((time.time() - t0) / 60, 2), "lr": args.lr,
                               "batch": args.batch, "init": args.init, "command": " ".join(sys.argv)}, f, indent=2)
            res = grounding_eval.evaluate(policy, task.eval, progress=False)
            rec = {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": loss.item(), **res}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            last_eval = time.time()
        if done:
            break


if __name__ == "__main__":
    main()
