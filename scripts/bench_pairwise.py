"""Illusory advantage (Pref-GRPO, docs/algorithms.md §6) measured on the shapes world.

    python scripts/bench_pairwise.py --threads 2         # 64 prompts x 8 images from the committed base
    python scripts/bench_pairwise.py --quick             # 8 prompts

Groups are sampled from a policy with the training sampler of configs/t2i/shapes_grpo.yaml (shared initial
noise, 3 SDE steps) at --noise-level: low noise gives groups of near-identical images, the regime of a policy
that has converged on a prompt, where a pointwise reward model scores 0.91 vs 0.92. The pointwise score
is a reward model with a small hackable term: the detector's graded score (strict + partial) plus
`--saturation-weight` x colored area. In groups whose pointwise scores differ by less than 1% (relative spread
(max - min) / mean), every difference comes from the hackable term; the script reports, for those groups and
for the others:
- the mean |advantage| under pointwise z-scoring (GRPO), and how often the advantage's sign follows the
  saturation term alone;
- the same under Pref-GRPO win rates from a pairwise judge that calls score gaps <= --margin ties, and from
  one that resolves every gap (margin 0: win rates are then ranks, and near-ties are amplified as much).
The last line is one JSON object.
"""

import argparse
import json
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "tasks/assets/shapes-base"))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--noise-level", type=float, default=0.05, help="SDE noise level of the sampler (training: 0.7)")
    p.add_argument("--saturation-weight", type=float, default=0.5)
    p.add_argument("--margin", type=float, default=0.01, help="judge: |score gap| <= margin is a tie")
    p.add_argument("--spread", type=float, default=0.01, help="'near-tie' groups: (max - min) / mean below this")
    p.add_argument("--quick", action="store_true", help="8 prompts")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import random

    from mmrl.algorithms.advantages import ADVANTAGES
    from mmrl.compose import build_policy, build_task, load_config
    from mmrl.reward import REWARDS
    from mmrl.rollout.pairwise import PairwiseReward, ScoreJudge

    cfg = load_config(os.path.join(ROOT, "configs/t2i/shapes_grpo.yaml"), [f"model.path={args.model}",
                                                                           f"sampler.noise_level={args.noise_level}"])
    policy, task = build_policy(cfg), build_task(cfg.task)
    n = 8 if args.quick else args.prompts
    t0 = time.time()
    with torch.no_grad():
        ro = policy.sample(task.sample(n, random.Random(args.seed)), args.group, torch.Generator().manual_seed(args.seed))
    sample_s = time.time() - t0
    pointwise = REWARDS["shapes"](strict_weight=0.5, saturation_weight=args.saturation_weight)
    r = pointwise(ro.outputs, ro.examples)
    valid = torch.ones(len(ro), dtype=torch.bool)
    a_point, _ = ADVANTAGES["grpo"](r["overall"], ro.group_id, valid, cfg.algo)
    t0 = time.time()
    w = PairwiseReward(ScoreJudge(pointwise, margin=args.margin), batch_size=512)(ro.outputs, ro.examples, ro.group_id)
    judge_s = time.time() - t0
    a_pair, _ = ADVANTAGES["grpo"](w["overall"], ro.group_id, valid, cfg.algo)
    w0 = PairwiseReward(ScoreJudge(pointwise, margin=0.0), batch_size=512)(ro.outputs, ro.examples, ro.group_id)
    a_rank, _ = ADVANTAGES["grpo"](w0["overall"], ro.group_id, valid, cfg.algo)  # a judge that resolves any gap

    rows = {"near_tie": [], "other": []}
    for g in torch.unique(ro.group_id):
        idx = (ro.group_id == g).nonzero().squeeze(-1)
        s = r["overall"][idx]
        spread = float((s.max() - s.min()) / s.mean().clamp(min=1e-8))
        if spread == 0:
            continue  # identical scores: zero advantage under both
        sat = r["saturation"][idx]
        gold_same = bool((r["strict"][idx] == r["strict"][idx][0]).all() and (r["partial"][idx] == r["partial"][idx][0]).all())
        sign_sat = torch.sign(sat - sat.mean())
        rows["near_tie" if spread < args.spread else "other"].append({
            "spread": spread, "gold_identical": gold_same,
            "point_abs": a_point[idx].abs().mean().item(), "pair_abs": a_pair[idx].abs().mean().item(),
            "rank_abs": a_rank[idx].abs().mean().item(),
            "point_follows_saturation": (torch.sign(a_point[idx]) == sign_sat).float().mean().item(),
            "pair_zero": (a_pair[idx].abs() < 1e-6).float().mean().item()})

    def summary(rs):
        if not rs:
            return {"groups": 0}
        m = lambda k: round(sum(x[k] for x in rs) / len(rs), 4)  # noqa: E731
        return {"groups": len(rs), "gold_identical_frac": m("gold_identical"), "mean_rel_spread": m("spread"),
                "pointwise_abs_adv": m("point_abs"), "pairwise_abs_adv": m("pair_abs"),
                "pairwise_no_margin_abs_adv": m("rank_abs"),
                "pointwise_sign_follows_saturation": m("point_follows_saturation"),
                "pairwise_zero_adv_frac": m("pair_zero")}

    out = {"prompts": n, "group": args.group, "noise_level": args.noise_level, "saturation_weight": args.saturation_weight, "margin": args.margin,
           "near_tie_spread_below": args.spread, "near_tie": summary(rows["near_tie"]), "other": summary(rows["other"]),
           "judge_pairs": int(w["comparisons"].sum().item() / 2), "sample_s": round(sample_s, 1),
           "judge_s": round(judge_s, 1)}
    for k in ("near_tie", "other"):
        print(f"{k}: {out[k]}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
