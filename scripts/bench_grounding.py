"""Benchmark grounding checkpoints: greedy answers -> R1@{0.3,0.5,0.7} (tIoU >= m, percent) and mIoU, with
unparseable answers counted as 0, beside the blind constant-answer baseline.

    python scripts/bench_grounding.py runs/grounding-sft runs/grounding_grpo/checkpoints/iter-000100/policy
    python scripts/bench_grounding.py CKPT --format charades_sta --annotations charades_sta_test.txt \\
        --durations Charades_v1_test.csv --video-dir Charades_v1_480 --fit-annotations charades_sta_train.txt
    python scripts/bench_grounding.py CKPT --format qvhighlights --annotations highlight_val_release.jsonl \\
        --video-dir videos --nframes 32 --max-pixels 200704

Without --annotations the embedded world's held-out videos are used (--world). The constant baseline is the
one window (as fractions of the duration) that maximizes mIoU on --fit-annotations (default: the world's
training queries, or the evaluated queries themselves, which flatters it). The last line is one JSON object.
"""

import argparse
import json
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="model folders or mmrl vlm policy checkpoints")
    p.add_argument("--format", default="charades_sta", choices=["charades_sta", "activitynet", "qvhighlights"])
    p.add_argument("--annotations", help="annotation file (default: the embedded world's test split)")
    p.add_argument("--durations", help="Charades_v1 csv (Charades-STA)")
    p.add_argument("--video-dir")
    p.add_argument("--fit-annotations", help="queries the constant baseline is fit on (same format)")
    p.add_argument("--fit-durations")
    p.add_argument("--world", default="runs/grounding_world")
    p.add_argument("--n", type=int, default=0, help="evaluate the first n queries (0 = all)")
    p.add_argument("--quick", action="store_true", help="the first 60 queries")
    p.add_argument("--prompt", default=None, help="prompt template with {query} (default: the task's)")
    p.add_argument("--text-first", action=argparse.BooleanOptionalAction, default=None,
                   help="the query before the video in the prompt (default: yes for the embedded world, as it "
                        "trains; no for real datasets)")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--nframes", type=int, default=None)
    p.add_argument("--min-pixels", type=int, default=56 * 56)
    p.add_argument("--max-pixels", type=int, default=56 * 56)
    p.add_argument("--backend", default="decord", choices=["decord", "torchcodec"])
    p.add_argument("--skip-broken", action="store_true", help="count unreadable videos (scored 0) instead of failing")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ood", action="store_true", help="the OOD world under --world: id, long, novel and crowded "
                   "splits side by side (tasks/grounding_world.py)")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.policy.token import load_token_policy
    from mmrl.video import VideoOptions
    from rewards.grounding import evaluate
    from tasks.grounding import GROUNDING_PROMPT, constant_baseline
    from tasks.grounding_data import load_dataset

    missing = "skip" if args.skip_broken else "raise"
    if args.annotations:
        rows = load_dataset(args.format, args.annotations, args.video_dir, args.durations, missing_video=missing)
        fit = (load_dataset(args.format, args.fit_annotations, args.video_dir, args.fit_durations or args.durations,
                            missing_video="skip") if args.fit_annotations else rows)
        template = args.prompt or GROUNDING_PROMPT
        text_first = bool(args.text_first)
    else:
        from tasks.grounding_world import OOD_SPLITS, PROMPT, build_world

        w = build_world(args.world, ood=args.ood)
        splits = {"id": "test", **({k: k for k in OOD_SPLITS} if args.ood else {})}
        rows = {name: load_dataset("charades_sta", w[s]["annotations"], w[s]["video_dir"], w[s]["durations"])
                for name, s in splits.items()}
        fit = load_dataset("charades_sta", w["train"]["annotations"], w["train"]["video_dir"],
                           w["train"]["durations"])
        template = args.prompt or PROMPT
        text_first = args.text_first is not False
    if not isinstance(rows, dict):
        rows = {"id": rows}
    video = VideoOptions(args.backend, args.fps, args.nframes, args.min_pixels, args.max_pixels)
    policies = {ck: load_token_policy(ck, video, "skip" if args.skip_broken else "raise", args.max_new_tokens)
                for ck in args.checkpoints}
    results, sizes = {}, {}
    for split, split_rows in rows.items():
        split_rows = [r for r in split_rows if r["windows"]]
        n = 60 if args.quick else (args.n or len(split_rows))
        examples = [{**r, "prompt": template.format(query=r["query"], duration=r["duration"]),
                     "text_first": text_first} for r in split_rows[:n]]
        sizes[split] = len(examples)
        res = {"constant_baseline": constant_baseline([r for r in fit if r["windows"]], examples)}
        b = res["constant_baseline"]
        print(f"[{split}] constant answer {b['window_fraction']} x duration: mIoU {b['mIoU']:.4f} R1@0.3 "
              f"{b['R1@0.3']:.1f} R1@0.5 {b['R1@0.5']:.1f} R1@0.7 {b['R1@0.7']:.1f}")
        for ck, policy in policies.items():
            t0 = time.time()
            r = evaluate(policy, examples)
            r["seconds"] = round(time.time() - t0, 1)
            r["skipped_videos"] = policy.skipped_examples
            res[ck] = r
            print(f"[{split}] {ck}: mIoU {r['mIoU']:.4f} R1@0.3 {r['R1@0.3']:.1f} R1@0.5 {r['R1@0.5']:.1f} "
                  f"R1@0.7 {r['R1@0.7']:.1f} parsed {r['parsed']:.3f} (n={r['n']})")
        results[split] = res
    if list(results) == ["id"]:  # one split: the flat layout earlier runs printed
        print(json.dumps({"n_queries": sizes["id"], "results": results["id"]}))
    else:
        print(json.dumps({"n_queries": sizes, "results": results}))


if __name__ == "__main__":
    main()
