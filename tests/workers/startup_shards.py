"""Worker for tests/test_startup_memory.py: a Trainer under FSDP2 on 2 processes loads its trained transformer into
shards (full fine-tuning with a frozen KL reference and EMA), then trains one iteration.

    torchrun --nproc_per_node 2 tests/workers/startup_shards.py MODEL OUT [--dtype bfloat16] [--lora]

--lora: LoRA (rank 4, KL to the base through the disabled adapters) instead: the frozen base is read into shards and
the adapters start there (init_adapters). Each rank checks what it holds and writes it to OUT.rankR.json (ranks'
prints would interleave); rank 0 writes OUT (safetensors) with the whole trained parameters after one iteration
(p0, p1, ... in parameter order).
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lora", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.parallel.shards import full
    from mmrl.policy.flow import FlowPolicy
    from mmrl.trainer import Trainer

    seen = {}
    parallelize = FlowPolicy.parallelize

    def spy(self, wrap, parallel):  # what the policy holds between building and sharding
        seen["meta_before_shard"] = all(t.is_meta for t in self.model.transformer.parameters())
        seen["ref_meta_before_shard"] = args.lora or all(t.is_meta for t in self._ref_copy["transformer"].parameters())
        return parallelize(self, wrap, parallel)

    FlowPolicy.parallelize = spy
    parallel = os.environ.get("WORLD_SIZE", "1") != "1"
    cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={args.model}", f"log.out_dir={os.path.dirname(args.out)}/run-{int(parallel)}",
        "log.tensorboard=false", "log.eval_at_start=false", f"train.parallel={'fsdp' if parallel else 'none'}",
        f"model.dtype={args.dtype}", "model.reference=auto", "algo.kl_coef=0.1", "train.ema_decay=0.5",
        "train.prompts_per_iter=3", "train.group_size=4", "train.minibatches=2",
        f"train.mixed_precision={'bf16' if args.dtype == 'bfloat16' else 'no'}",
        f"model.lora.enabled={str(args.lora).lower()}", "model.lora.rank=4", "model.lora.alpha=8"])
    tr = Trainer(cfg)
    if args.lora:
        report = lora_report(cfg, tr, args.model, seen) if parallel else {}
    else:
        report = full_report(tr, args.model, seen)
    with open(f"{args.out}.rank{tr.dist.rank}.json", "w") as f:
        json.dump(report, f)
    tr.step(0)
    trained = [full(t).detach() for t in tr.params]
    if tr.dist.main:
        save_file({f"p{i}": t.contiguous() for i, t in enumerate(trained)}, args.out)
    tr.dist.close()


def full_report(tr, model: str, seen: dict) -> dict:
    from safetensors.torch import load_file

    from mmrl.parallel.shards import full

    live = list(tr.policy.model.transformer.parameters())
    ref = list(tr.policy._ref_copy["transformer"].parameters())
    names = [n for n, _ in tr.policy.model.transformer.named_parameters()]
    disk = load_file(os.path.join(model, "transformer", "diffusion_pytorch_model.safetensors"))
    whole = lambda ts: [full(t).detach() for t in ts]  # a collective under FSDP: every rank
    live_full, ref_full, ema_full = whole(live), whole(ref), whole(tr.ema.shadow)
    report = {
        **seen,
        "live_sharded": all(hasattr(t, "to_local") for t in live),
        "ref_sharded": all(hasattr(t, "to_local") for t in ref),
        "ema_sharded": all(hasattr(t, "to_local") for t in tr.ema.shadow),
        "live_dtypes": sorted({str(t.dtype) for t in live}), "ref_dtypes": sorted({str(t.dtype) for t in ref}),
        "ema_dtypes": sorted({str(t.dtype) for t in tr.ema.shadow}),
        "local_fraction": sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in live)
        / sum(t.numel() for t in live),
        "live_equals_disk": all(torch.equal(f, disk[n].to(f.dtype)) for n, f in zip(names, live_full)),
        "ref_equals_disk": all(torch.equal(f, disk[n].to(f.dtype)) for n, f in zip(names, ref_full)),
        "ema_equals_live": all(torch.equal(a, b) for a, b in zip(ema_full, live_full)),
    }
    return report


def lora_report(cfg, tr, model: str, seen: dict) -> dict:
    """LoRA under FSDP: the frozen base sharded and equal to the file, the adapters equal to one process's start."""
    from safetensors.torch import load_file

    from mmrl.compose import build_policy
    from mmrl.parallel.shards import full
    from mmrl.models.shard_load import file_key, is_adapter

    named = dict(tr.policy.model.transformer.named_parameters())
    base = {n: t for n, t in named.items() if not is_adapter(n)}
    adapters = [n for n in named if is_adapter(n)]
    whole = dict(build_policy(cfg).model.transformer.named_parameters())  # one process's start
    disk = load_file(os.path.join(model, "transformer", "diffusion_pytorch_model.safetensors"))
    return {"meta_before_shard": seen["meta_before_shard"],
            "live_sharded": all(hasattr(t, "to_local") for t in named.values()),
            "local_fraction": sum(t.to_local().numel() for t in base.values()) / sum(t.numel() for t in base.values()),
            "live_equals_disk": all(torch.equal(full(t).detach(), disk[file_key(n)].to(t.dtype))
                                    for n, t in base.items()),
            "adapters": len(adapters),
            "adapters_equal_one_process": all(torch.equal(full(named[n]).detach(), whole[n].detach())
                                              for n in adapters)}


if __name__ == "__main__":
    main()
