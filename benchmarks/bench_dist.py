"""Several processes on CPU (gloo, 1 thread each): the sharded held-out evaluation (1 vs 2 processes: figures and
wall time) and the peak memory of an FSDP2 save per rank, on the shapes world's base model.

    python benchmarks/bench_dist.py            # 128 held-out prompts
    python benchmarks/bench_dist.py --quick    # 24 held-out prompts

Save memory: each rank's resident-memory peak during `Trainer.save()` above its level before it (VmHWM after a
reset, mmrl/testing/memory.py), beside the trained tensors' bytes and the rank's shard bytes. Rank 0 keeps whole
CPU copies of what it writes; the other ranks hold one gathered tensor at a time. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(out: str, prompts: int, parallel: str) -> None:
    import torch

    from mmrl.compose import load_config
    from mmrl.testing.memory import reset_peak, rss_kib
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(ROOT, "configs/t2i/shapes_grpo.yaml"), [
        f"log.out_dir={out}/run-{parallel}", "log.tensorboard=false", "log.progress=false", f"train.parallel={parallel}",
        f"task.eval_prompts={prompts}", "train.prompts_per_iter=2", "train.group_size=2", "train.minibatches=1"])
    tr = Trainer(cfg)
    t0 = time.perf_counter()
    res = tr.evaluate(0)
    eval_s = time.perf_counter() - t0
    row = {"rank": tr.dist.rank, "world": tr.dist.world, "eval_s": eval_s,
           "eval": {k: v for k, v in res.items() if k != "per_category"}}
    if parallel == "fsdp":
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in tr.params)
        before = reset_peak()
        tr.save()
        row.update(save_peak_mib=(rss_kib("VmHWM") - before) / 1024, shard_mib=local / 2**20,
                   trained_mib=sum(p.numel() * p.element_size() for p in tr.params) / 2**20)
    rows = tr.dist.gather_list([row])
    if tr.dist.main:
        with open(os.path.join(out, f"{parallel}-{tr.dist.world}.json"), "w") as f:
            json.dump(rows, f)
    tr.dist.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="24 held-out prompts instead of 128")
    p.add_argument("--worker", nargs=3, metavar=("OUT", "PROMPTS", "PARALLEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.worker[2])
    prompts = 24 if args.quick else 128
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--worker", out, str(prompts)]
        two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        for cmd in ([sys.executable, *me, "none"], [*two, *me, "fsdp"]):
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if r.returncode:
                sys.exit(r.stderr[-3000:])
        one, fsdp = (json.load(open(os.path.join(out, f))) for f in ("none-1.json", "fsdp-2.json"))
    res = {"eval_prompts": prompts, "eval_s_1proc": round(one[0]["eval_s"], 2),
           "eval_s_2proc": round(max(r["eval_s"] for r in fsdp), 2),
           "eval_same": all(abs(one[0]["eval"][k] - fsdp[0]["eval"][k]) < 1e-4 for k in one[0]["eval"]),
           "eval_1proc": one[0]["eval"], "eval_2proc": fsdp[0]["eval"],
           "save": [{k: round(r[k], 2) for k in ("rank", "save_peak_mib", "shard_mib", "trained_mib")} for r in fsdp]}
    res["eval_speedup"] = round(res["eval_s_1proc"] / res["eval_s_2proc"], 2)
    print(f"evaluation of {prompts} prompts: {res['eval_s_1proc']} s on 1 process, {res['eval_s_2proc']} s on 2 "
          f"(x{res['eval_speedup']}); same figures: {res['eval_same']}")
    for r in res["save"]:
        print(f"FSDP2 save, rank {r['rank']}: peak +{r['save_peak_mib']} MiB (its shard {r['shard_mib']} MiB, trained "
              f"tensors {r['trained_mib']} MiB)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
