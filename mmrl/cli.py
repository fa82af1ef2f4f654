"""The command line:
    mmrl train CONFIG [--resume] [key=value ...]        train (mmrl/trainer.py)
    mmrl eval CONFIG [CHECKPOINT ...] [key=value ...]   the config's held-out benchmark (mmrl/eval.py)
    mmrl validate CONFIG [key=value ...] [--nproc N]    check a config and every name in it (and that N processes
                                                        can run it), build nothing
    mmrl plan CONFIG [--world N] [--cp D] [key=value ...]  memory and FLOPs per GPU at real size (mmrl/plan.py)
    mmrl export CHECKPOINT OUT                          a merged model folder (mmrl/export.py)
    mmrl serve-reward NAME [--kwargs JSON] [--port P]   a reward over HTTP (mmrl/reward_server.py)"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(prog="mmrl", description="Group-relative RL for generators and (video) LLMs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run GRPO from a YAML config")
    tr.add_argument("config", help="YAML config (see configs/)")
    tr.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-4")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in log.out_dir")
    ev = sub.add_parser("eval", help="score the base model and checkpoints on the config's held-out benchmark")
    ev.add_argument("config", help="YAML config: its task, reward and base model")
    ev.add_argument("rest", nargs="*", metavar="CHECKPOINT|key=value",
                    help="trainer checkpoints (runs/NAME/checkpoints/iter-N), policy or model folders; overrides")
    ev.add_argument("--seed", type=int, default=0, help="example i uses seed SEED + i")
    ev.add_argument("--no-base", action="store_true", help="skip the config's base model")
    va = sub.add_parser("validate", help="check a config: keys, types, values and every registry name")
    va.add_argument("config")
    va.add_argument("overrides", nargs="*")
    va.add_argument("--nproc", type=int, default=1, help="also check it runs on this many processes (torchrun)")
    sv = sub.add_parser("serve-reward", help="serve a registered reward over HTTP (reward.name=remote calls it)")
    sv.add_argument("name", help="reward registry key, e.g. shapes, clip_score, pickscore")
    sv.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the reward")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    sv.add_argument("--port", type=int, default=8765)
    sv.add_argument("--max-batch", type=int, default=256, help="samples scored in one reward call at most")
    sv.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a batch waits for more requests")
    sv.add_argument("--queue", type=int, default=64, help="queued requests before answering 503 (backpressure)")
    sv.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a queued request gets 504")
    ex = sub.add_parser("export", help="merge a trained policy (LoRA fused) into a plain save_pretrained folder")
    ex.add_argument("checkpoint", help="a policy folder or a trainer checkpoint (runs/NAME/checkpoints/iter-N)")
    ex.add_argument("out", help="the new model folder")
    pl = sub.add_parser("plan", help="parameters, memory and FLOPs of a config at real size (meta device, no weights)")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.micro_batch=4")
    pl.add_argument("--arch", help="a published architecture instead of model.path's config (mmrl/models/architectures.py)")
    pl.add_argument("--prompt-tokens", type=int, default=512, help="token policies: prompt length with media tokens")
    pl.add_argument("--world", type=int, default=1, help="data-parallel processes (each samples whole groups)")
    pl.add_argument("--cp", type=int, default=None, help="context-parallel ranks splitting one video's tokens "
                                                         "(default: the config's train.context_parallel)")
    args, extra = p.parse_known_args(argv)  # `--resume` may come before or after the overrides
    if extra and (args.cmd not in ("train", "plan", "validate") or any(x.startswith("-") or "=" not in x for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "serve-reward":
        from mmrl.reward_server import serve_main

        return serve_main(args)
    if args.cmd in ("eval", "validate"):
        from mmrl.compose import load_config
        from mmrl.eval import eval_main

        if args.cmd == "eval":
            args.overrides = [x for x in args.rest if "=" in x and not os.path.exists(x)]
            args.checkpoints = [x for x in args.rest if x not in args.overrides]
        try:
            cfg = load_config(args.config, args.overrides)
            if args.cmd == "validate":
                from mmrl.distributed import check_parallel_config

                check_parallel_config(cfg, args.nproc)
        except (ValueError, FileNotFoundError) as e:
            print(f"mmrl: config error: {e}", file=sys.stderr)
            return 2
        if args.cmd == "validate":
            print(f"{args.config}: valid (model.policy={cfg.model.policy}, task.name={cfg.task.name}, "
                  f"reward.name={cfg.reward.name}" + (f", {args.nproc} processes" if args.nproc > 1 else "") + ")")
            return 0
        return eval_main(args, cfg)
    if args.cmd == "plan":
        from mmrl.compose import load_config
        from mmrl.plan import format_plan, plan

        cfg = load_config(args.config, args.overrides)
        res = plan(cfg, args.arch, args.prompt_tokens, args.world,
                   args.cp if args.cp is not None else cfg.train.context_parallel)
        print(format_plan(res))
        print(json.dumps(res))
        return 0
    if args.cmd == "export":
        from mmrl.export import export

        print(export(args.checkpoint, args.out))
        return 0
    if args.cmd == "train":
        from mmrl.compose import load_config
        from mmrl.runs import train

        try:
            cfg = load_config(args.config, args.overrides)
            if args.cmd == "validate":
                from mmrl.distributed import check_parallel_config

                check_parallel_config(cfg, args.nproc)
        except (ValueError, FileNotFoundError) as e:
            print(f"mmrl: config error: {e}", file=sys.stderr)
            return 2
        res = train(cfg, resume=args.resume)
        print(json.dumps({k: v for k, v in res.items()}, default=str))
        return 0
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
