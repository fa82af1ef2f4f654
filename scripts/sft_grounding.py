"""Make the SFT base of the embedded grounding world: a small Qwen2.5-VL (the real transformers class, random
init, tokenizer and processor built locally) fine-tuned on the world's training queries to answer
`<think></think><answer>S to E</answer>`.

    python scripts/sft_grounding.py --minutes 10 --out runs/grounding-sft          # the SFT base
    python scripts/sft_grounding.py --minutes 5 --init runs/grounding-sft --out runs/grounding-control
                                                                                    # equal-time SFT control

Training-label regimes and modes (docs/results.md, "Where RL should beat supervised training"):

    --label-pool N --pool-seed S     SFT on the seeded subset of N training queries GRPO's task.kwargs.label_pool
                                     trains on (one function picks both: tasks/grounding.py select_label_pool)
    --label-noise F --noise-seed S   that fraction of the training spans replaced, exactly as task.kwargs.label_noise
                                     does for GRPO (tasks/grounding.py apply_label_noise); held-out spans stay true
    --rft                            rejection-sampling fine-tuning: sample --group completions of --sample-prompts
                                     queries from the current model, keep those whose coarse bit (tIoU >= 0.5) is 1,
                                     SFT on them; the model never sees a span (sampling counts in --minutes)
    --dpo                            DPO on its own samples: each group's best and worst (GroundingReward with
                                     --coarse, as the reward-only GRPO arm scores them) against the frozen start
    --until-plateau --patience 3     SFT until the held-out mIoU on --eval-n in-distribution queries (evaluated every
                                     --eval-every minutes, and at the start) has not risen for --patience evaluations
                                     (--minutes is then only a cap, the lr has no cool-down); --out holds the best

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
from mmrl.policy.token import TokenPolicy, load_token_model
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
    g = p.add_argument_group("training-label regimes (the task kwargs GRPO takes: the same queries and spans)")
    g.add_argument("--label-pool", type=int, default=None, help="train on a seeded subset of this many queries")
    g.add_argument("--pool-seed", type=int, default=0)
    g.add_argument("--label-noise", type=float, default=0.0, help="fraction of training spans replaced")
    g.add_argument("--noise-seed", type=int, default=0)
    m = p.add_argument_group("modes (default: SFT on the labels)")
    mode = m.add_mutually_exclusive_group()
    mode.add_argument("--rft", action="store_true", help="rejection-sampling fine-tuning on own samples whose bit is 1")
    mode.add_argument("--dpo", action="store_true", help="DPO on each sampled group's best / worst completion")
    m.add_argument("--group", type=int, default=8, help="--rft / --dpo: completions sampled per query")
    m.add_argument("--sample-prompts", type=int, default=8, help="--rft / --dpo: queries per sampling round")
    m.add_argument("--coarse", choices=["bit", "bucket"], default="bit", help="--dpo: the reward that ranks a group")
    m.add_argument("--dpo-beta", type=float, default=0.1)
    m.add_argument("--until-plateau", action="store_true", help="stop when the held-out id mIoU stops rising")
    m.add_argument("--patience", type=int, default=3, help="--until-plateau: evaluations without a rise")
    args = p.parse_args(argv)
    if args.patience < 1 or args.group < 2 or args.sample_prompts < 1:
        p.error("--patience >= 1, --group >= 2 and --sample-prompts >= 1 are needed")
    return args


class Plateau:
    """The plateau rule of --until-plateau: `update(score)` records an evaluation and says whether it is a new best
    (strictly above every earlier one); `stop` once `patience` evaluations in a row have not been."""

    def __init__(self, patience: int):
        self.patience, self.best, self.best_index, self.since, self.history = patience, None, -1, 0, []

    def update(self, score: float) -> bool:
        self.history.append(score)
        if self.best is None or score > self.best:
            self.best, self.best_index, self.since = score, len(self.history) - 1, 0
            return True
        self.since += 1
        return False

    @property
    def stop(self) -> bool:
        return self.since >= self.patience


def build_base(size: str, world_examples: list[dict], answer_template: str):
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer

    corpus = [ex["prompt"] for ex in world_examples] + [answer_template.format(start=s, end=e)
                                                        for s in range(9) for e in range(9)]
    tok = build_tokenizer(corpus)
    return build_model("qwen2_5_vl", tok, size), build_processor("qwen2_5_vl", tok)


def dpo_loss(policy: TokenPolicy, rollout: Rollout, winners: torch.Tensor, losers: torch.Tensor,
             beta: float) -> torch.Tensor:
    """Mean -log sigmoid(beta [(log pi(w) - log ref(w)) - (log pi(l) - log ref(l))]) over the pairs, sequence
    log-probs of the sampled completions; the reference is the policy's frozen copy of its starting weights."""
    idx = torch.cat([winners, losers])
    mask = rollout.action_mask[idx]

    def seq(lp):
        return (lp * mask.to(lp.device, lp.dtype)).sum(-1)

    with torch.no_grad(), policy.reference():
        ref = seq(policy.log_prob(rollout, idx).log_prob)
    margin = seq(policy.log_prob(rollout, idx).log_prob) - ref
    k = len(winners)
    return -torch.nn.functional.logsigmoid(beta * (margin[:k] - margin[k:])).mean()


def rft_keep(reward, rollout) -> list[tuple[dict, str]]:
    """The (example, completion) rows of a sampled rollout whose coarse bit is 1 (reward: GroundingReward with
    coarse="bit"; the example's span is read by the reward only, never trained on)."""
    bits = reward(rollout.outputs, rollout.examples)["coarse"]
    return [(rollout.examples[i], rollout.outputs[i]) for i in (bits > 0.5).nonzero().flatten().tolist()]


def best_worst_pairs(overall: torch.Tensor, group_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winner rows, loser rows): each group's highest and lowest reward (first of ties); groups whose rewards
    are all equal give no pair."""
    w, lo = [], []
    for g in torch.unique(group_id).tolist():
        rows = (group_id == g).nonzero().squeeze(-1)
        r = overall[rows]
        if r.max() > r.min():
            w.append(int(rows[r.argmax()]))
            lo.append(int(rows[r.argmin()]))
    return torch.tensor(w, dtype=torch.long), torch.tensor(lo, dtype=torch.long)


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


def make_task(args):
    """The world's task with the training-label regime of the options: the same task kwargs (so the same queries
    and spans) a GRPO config with task.kwargs.label_pool / label_noise gives."""
    from mmrl.config import TaskConfig
    from tasks.grounding import GroundingWorldTask

    return GroundingWorldTask(TaskConfig(eval_prompts=args.eval_n), root=args.world, train_videos=args.train_videos,
                              test_videos=args.test_videos, ood=args.ood, label_pool=args.label_pool,
                              pool_seed=args.pool_seed, label_noise=args.label_noise, noise_seed=args.noise_seed)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from rewards import grounding as grounding_reward

    task = make_task(args)
    if args.init:
        model, processor = load_token_model(args.init)
        print(f"initialized from {args.init}")
    else:
        model, processor = build_base(args.size, task.train_clean, task.answer_template)
    policy = TokenPolicy(model=model, processor=processor, sampler_cfg=SamplerConfig(temperature=1.0, max_new_tokens=16),
                         lora_cfg=LoraConfig(), video=VIDEO, freeze_vision=False, reference="auto" if args.dpo else "none")
    params = policy.trainable_parameters()
    mode = "rft" if args.rft else "dpo" if args.dpo else "sft"
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params; "
          f"{len(task.train)} train / {len(task.eval)} held-out queries; mode {mode}; {task.label_info}")
    # --until-plateau scores the in-distribution held-out queries only (the id split of the OOD world)
    eval_set = [e for e in task.eval if e.get("category", "id") == "id"] if args.until_plateau else task.eval
    plateau = Plateau(args.patience) if args.until_plateau else None
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    log = open(args.out.rstrip("/") + ".log.jsonl", "a")
    gen = torch.Generator().manual_seed(args.seed)
    if args.rft or args.dpo:
        policy.defer_old_log_prob = True  # sampled rows are scored by the update itself
        reward = grounding_reward.GroundingReward(coarse="bit" if args.rft else args.coarse)
    counts = {"sampled": 0, "kept": 0, "pairs": 0}
    buffer: list[tuple[dict, str]] = []
    t0 = time.time()

    def left() -> float:
        return 1 - (time.time() - t0) / (args.minutes * 60)

    def next_loss():
        """The loss of the next step, or None when the budget ran out while sampling."""
        if args.rft:  # a batch of own completions whose bit is 1 (FIFO: each is trained on once)
            while len(buffer) < args.batch:
                if left() <= 0:
                    return None
                ro = policy.sample(task.sample(args.sample_prompts, rng), args.group, gen)
                kept = rft_keep(reward, ro)
                counts["sampled"] += len(ro.outputs)
                counts["kept"] += len(kept)
                buffer.extend(kept)
            batch = [buffer.pop(0) for _ in range(args.batch)]
            return nll(policy, [b[0] for b in batch], [b[1] for b in batch])
        if args.dpo:  # sampling rounds until one has a pair
            while True:
                if left() <= 0:
                    return None
                ro = policy.sample(task.sample(args.sample_prompts, rng), args.group, gen)
                counts["sampled"] += len(ro.outputs)
                w, lo = best_worst_pairs(reward(ro.outputs, ro.examples)["overall"], ro.group_id)
                if len(w):
                    counts["pairs"] += len(w)
                    return dpo_loss(policy, ro, w, lo, args.dpo_beta)
        batch = task.sample(args.batch, rng)
        return nll(policy, batch, [task.reference_output(ex) for ex in batch])

    def save(step, extra=None):
        with atomic_dir(args.out) as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
            with open(os.path.join(tmp, "sft_info.json"), "w") as f:
                json.dump({"step": step, "minutes": round((time.time() - t0) / 60, 2), "lr": args.lr,
                           "batch": args.batch, "init": args.init, "mode": mode, **task.label_info, **counts,
                           **(extra or {}), "command": " ".join(sys.argv)}, f, indent=2)

    def evaluate(step, loss) -> dict:
        res = grounding_reward.evaluate(policy, eval_set, progress=False)
        rec = {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": loss, **res}
        if args.rft or args.dpo:
            rec.update(counts)
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        return rec

    def plateau_eval(step, loss) -> None:
        """Score the model; save it when it is the best so far (--out always holds the best)."""
        rec = evaluate(step, loss)
        if plateau.update(rec["mIoU"]):
            save(step, {"best_mIoU": rec["mIoU"], "evaluation": len(plateau.history) - 1})

    step, stopped = 0, "time"
    if plateau is not None:
        plateau_eval(0, None)  # the starting point is the first best
    last_eval = time.time()
    while True:
        loss = next_loss()
        done = loss is None
        if not done:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            frac = left()
            cool = 1.0 if plateau is not None else max(frac, 0.0) / 0.2  # --until-plateau: no cool-down
            for g in opt.param_groups:  # warm-up, constant, linear cool-down over the last 20% of the budget
                g["lr"] = args.lr * min(1.0, (step + 1) / 100, cool)
            opt.step()
            step += 1
            if step % 25 == 0:
                extra = "".join(f" {k} {v}" for k, v in counts.items() if v) if (args.rft or args.dpo) else ""
                print(f"step {step} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min{extra}", flush=True)
            done = frac <= 0
        loss_value = None if loss is None else loss.item()
        if done or time.time() - last_eval >= args.eval_every * 60:
            if plateau is not None:
                plateau_eval(step, loss_value)
                if plateau.stop:
                    stopped = "plateau"
                    done = True
            else:
                save(step)
                evaluate(step, loss_value)
            last_eval = time.time()
        if done:
            break
    if plateau is not None:
        summary = {"stopped": stopped, "best_mIoU": plateau.best, "best_evaluation": plateau.best_index,
                   "history": plateau.history, "patience": args.patience, "eval_every_min": args.eval_every,
                   "minutes": round((time.time() - t0) / 60, 2), "steps": step}
        with open(os.path.join(args.out, "plateau.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps({"plateau": summary}), flush=True)


if __name__ == "__main__":
    main()
