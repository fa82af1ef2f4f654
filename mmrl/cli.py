"""The command line:
    mmrl train CONFIG [--resume | --overwrite] [--json] [k=v ...]   train (mmrl/runs.py, mmrl/trainer.py)
    mmrl eval CONFIG [RUN|CHECKPOINT ...] [--draws K] [--json] [k=v ...]  the held-out benchmark (mmrl/eval.py)
    mmrl sample CONFIG [RUN|CHECKPOINT ...] [--prompts ...]      images / videos and a contact sheet (mmrl/sample.py)
    mmrl validate CONFIG [k=v ...] [--nproc N] [--resume|--overwrite]  train's checks, no weights (mmrl/preflight.py)
    mmrl plan CONFIG [--world N] [--cp D] [--json] [k=v ...]     memory and FLOPs per GPU at real size (mmrl/plan.py)
    mmrl export CHECKPOINT OUT                                   a merged model folder (mmrl/export.py)
    mmrl serve-reward NAME [--kwargs JSON] [--port P]            a reward over HTTP (mmrl/reward_server.py)

Options may come anywhere on the line. Tables by default; --json prints one JSON object instead (train, eval, plan). A user error (mmrl.errors.UserError: a bad config, a missing file, a run
folder in use, an unknown or unimportable name) prints one message naming the fix and exits with status 2;
`--debug` (or MMRL_DEBUG=1) shows the traceback instead. Any other exception is a bug somewhere (mmrl, a library,
a plugin's code): it keeps its traceback and exits with status 1. The working directory and the config file's
folder are importable, so `reward.name: my_rewards:score` finds my_rewards.py in either."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from mmrl.errors import UserError


def add_sample_parser(subparsers):
    """Register `sample` (mmrl/sample.py) on the CLI's subparsers."""
    sp = subparsers.add_parser("sample", help="generate from the base model and checkpoints: images, videos, "
                                              "rewards and a contact sheet")
    sp.add_argument("config", help="YAML config: its task, reward and base model")
    sp.add_argument("rest", nargs="*", metavar="CKPT|key=value",
                    help="run folders (log.out_dir: the latest checkpoint), trainer checkpoints "
                         "(runs/NAME/checkpoints/iter-N), policy or model folders; section.key=value overrides")
    sp.add_argument("--prompts", nargs="+", action="extend", metavar="FILE_OR_TEXT",
                    help="prompt files (.txt: one per line; .jsonl: a \"prompt\" field) or literal prompts "
                         "(default: the first N held-out examples of the config's task)")
    sp.add_argument("--n", type=int, default=24, help="held-out examples when no --prompts are given, drawn evenly "
                                                      "over the task's categories (default 24)")
    sp.add_argument("--seed", type=int, default=0, help="prompt i uses seed SEED + i (the same for every model)")
    sp.add_argument("--out", help="output folder (default runs/samples/<config stem>)")
    sp.add_argument("--base", action="store_true", help="also the config's base model (model.path), first")
    sp.add_argument("--fps", type=int, default=8, help="frames per second of video files (default 8)")
    sp.set_defaults(overrides=[])  # key=value items the CLI's parse_known_args leaves over are appended here
    return sp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmrl", description="Group-relative RL for generators and (video) LLMs.")
    p.add_argument("--version", action="version", version=f"mmrl {version()}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (also MMRL_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run GRPO from a YAML config")
    tr.add_argument("config", help="YAML config (see configs/; configs/quickstart.yaml is a 3-minute first run)")
    tr.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-4")
    tr.add_argument("--resume", action="store_true", help="continue the run in log.out_dir (newest intact checkpoint)")
    tr.add_argument("--overwrite", action="store_true", help="delete the run in log.out_dir and start over")
    tr.add_argument("--json", action="store_true", help="print results.json's content at the end instead of the "
                                                        "table (before / after, verdict, where things went)")
    ev = sub.add_parser("eval", help="score the base model and checkpoints on the config's held-out benchmark")
    ev.add_argument("config", help="YAML config: its task, reward and base model")
    ev.add_argument("rest", nargs="*", metavar="RUN|CHECKPOINT|key=value",
                    help="run folders (runs/NAME: newest checkpoint), trainer checkpoints (runs/NAME/checkpoints/"
                         "iter-N), policy or model folders; overrides")
    ev.add_argument("--seed", type=int, default=None, help="example i uses seed SEED + i (default: the trainer's "
                                                           "evaluation seed, so the figures match a run's eval/)")
    ev.add_argument("--no-base", action="store_true", help="skip the config's base model")
    ev.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of the table")
    ev.add_argument("--draws", type=int, default=None, metavar="K",
                    help="score each model K times, noise seeds SEED ... SEED+K-1, and report the mean and each "
                         "draw (default: the config's log.eval_draws, 1; a greedy token policy's draws are identical)")
    add_sample_parser(sub)
    va = sub.add_parser("validate", help="check a config and everything it names, without loading weights")
    va.add_argument("config")
    va.add_argument("overrides", nargs="*")
    va.add_argument("--nproc", type=int, default=1, help="also check it runs on this many processes (torchrun)")
    va.add_argument("--resume", action="store_true", help="check log.out_dir as `train --resume` would take it")
    va.add_argument("--overwrite", action="store_true", help="check log.out_dir as `train --overwrite` would take it")
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
    pl.add_argument("--arch", metavar="ARCH",
                    help="a published architecture instead of model.path's config (each model family's, e.g. "
                         "sd35-medium, flux1-dev, flux2-dev, wan22-a14b, qwen-image, z-image-turbo, qwen25-vl-7b, "
                         "janus-pro-7b; an unknown name lists them all)")
    pl.add_argument("--prompt-tokens", type=int, default=None,
                    help="token policies: prompt length with media tokens (default 512); janus: before its image tokens (48)")
    pl.add_argument("--world", type=int, default=1, help="data-parallel processes (each samples whole groups)")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the table")
    pl.add_argument("--gpu-gib", type=float, default=80.0,
                    help="train.micro_batch=auto: the GPU memory it fits (default 80, an H100 / A100 80 GB)")
    pl.add_argument("--cp", type=int, default=None, help="context-parallel ranks splitting one video's tokens "
                                                         "(default: the config's train.context_parallel)")
    return p


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("mmrl")
    except Exception:  # not installed (run from a clone)
        return "0.1.0"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' / diffusers' loading bars: a 0.00 s load
    if not sys.stderr.isatty():  # a log file or a pipe: no progress bars (their cursor codes), one line per event
        os.environ.setdefault("TQDM_DISABLE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    p = parser()
    args, extra = p.parse_known_args([a for a in argv if a != "--debug"])
    args.debug = debug  # options may come before or after positionals and overrides
    if any(x.startswith("-") for x in extra):
        p.error(f"unrecognized arguments: {' '.join(x for x in extra if x.startswith('-'))}")
    if args.cmd in ("eval", "sample"):  # their positionals may follow options
        args.rest += extra
    elif extra and args.cmd in ("train", "plan", "validate", "sample") and all("=" in x for x in extra):
        args.overrides += extra
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for folder in (os.getcwd(), os.path.dirname(os.path.abspath(getattr(args, "config", None) or "."))):
        if folder not in sys.path:  # plugins (reward.name: my_rewards:fn) beside the user or the config
            sys.path.insert(0, folder)
    try:
        return run(args)
    except UserError as e:  # only mmrl's own input checks: anything else is a bug and keeps its traceback
        if args.debug or os.environ.get("MMRL_DEBUG"):
            raise
        print(f"mmrl {args.cmd}: error: {e}\n(--debug shows the traceback)", file=sys.stderr)
        return 2


def run(args) -> int:
    from mmrl.compose import load_config

    if args.cmd == "serve-reward":
        from mmrl.reward_server import serve_main

        return serve_main(args)
    if args.cmd == "export":
        from mmrl.export import export, how_to_load

        out = export(args.checkpoint, args.out)
        print(f"exported to {out}\nload it with: {how_to_load(out)}")
        return 0
    if args.cmd == "sample":
        from mmrl.sample import run as sample

        return sample(args)
    if args.cmd == "eval":
        args.overrides = [x for x in args.rest if "=" in x and not os.path.exists(x)]
        args.checkpoints = [x for x in args.rest if x not in args.overrides]
    if not sys.stderr.isatty() and not any(o.startswith("log.progress=") for o in args.overrides):
        args.overrides.append("log.progress=false")  # a log file: one line per iteration, no bar control characters
    cfg = load_config(args.config, args.overrides)
    if args.cmd == "plan":
        from mmrl.plan import format_plan, plan

        cp = args.cp if args.cp is not None else cfg.train.context_parallel
        if cfg.train.micro_batch == "auto":  # the pick for a GPU of --gpu-gib, then the plan of that pick
            from mmrl.micro_batch import fit_micro_batch

            cfg.train.micro_batch = fit_micro_batch(cfg, args.gpu_gib, args.arch, args.world, cp,
                                                    args.prompt_tokens)["micro_batch"]
            print(f"train.micro_batch=auto on {args.gpu_gib:g} GiB: {cfg.train.micro_batch}")
        res = plan(cfg, args.arch, args.prompt_tokens, args.world, cp, measured=True)
        print(json.dumps(res) if args.json else format_plan(res))
        return 0
    if args.cmd in ("validate", "train"):
        from mmrl import preflight

        t0 = time.time()
        problems = preflight.check(cfg, getattr(args, "nproc", int(os.environ.get("WORLD_SIZE", "1"))), args.config,
                                   (args.resume, args.overwrite) if args.cmd == "validate" else None)
        if problems:
            print(f"mmrl {args.cmd}: {args.config}: {len(problems)} problem(s):\n" +
                  "\n".join(f"  - {x}" for x in problems), file=sys.stderr)
            return 2
        if args.cmd == "validate":
            print(f"{args.config}: valid (model.policy={cfg.model.policy}, task.name={cfg.task.name}, reward.name="
                  f"{cfg.reward.name}" + (f", {args.nproc} processes" if args.nproc > 1 else "") +
                  f"; checked in {time.time() - t0:.1f} s)")
            return 0
        from mmrl.report import emit
        from mmrl.runs import train

        command = " ".join(["mmrl train", args.config, *(o for o in args.overrides if o != "log.progress=false")])
        res = train(cfg, resume=args.resume, overwrite=args.overwrite, command=command)
        emit(res, as_json=args.json)  # rank 0 only
        return 0
    if args.cmd == "eval":
        from mmrl.eval import eval_main
        from mmrl.evaluation import EVAL_SEED

        from mmrl.devices import set_cpu_threads

        set_cpu_threads(cfg.train.threads)  # as the trainer: the free cores, or the count a shared machine sets

        args.seed = EVAL_SEED if args.seed is None else args.seed
        return eval_main(args, cfg)
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
