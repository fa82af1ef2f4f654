"""Peak memory of one phase of a training run on CPU, measured in a fresh process (Linux).

`measure(config, overrides)` builds a Trainer, samples one rollout, then runs one training pass (one minibatch,
gradients kept); it reports the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs
after malloc_trim returns freed heap) minus its resident memory before each phase: what the phase added at its
peak. benchmarks/bench_memory.py and the check of `mmrl plan` against reality use it.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys


def rss_kib(field: str = "VmRSS") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Return freed heap to the OS, reset the peak to the current resident size, and return that size (KiB)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def _child(spec: dict) -> dict:
    import random

    import torch

    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    torch.set_num_threads(spec.get("threads", 1))
    torch.manual_seed(0)
    tr = Trainer(load_config(spec["config"], spec["overrides"]))
    tr.policy.defer_old_log_prob = False
    before = reset_peak()
    rollout, _, _, _ = tr.collect(random.Random(0), torch.Generator().manual_seed(0))
    sample_peak = rss_kib("VmHWM") - before
    if spec.get("resample_whole"):  # generation in parts draws other tokens: train on the unsplit rollout
        micro, tr.policy.micro_batch = tr.policy.micro_batch, 0
        rollout, _, _, _ = tr.collect(random.Random(0), torch.Generator().manual_seed(0))
        tr.policy.micro_batch = micro
    tr.opt.step, tr.opt.zero_grad = (lambda: None), (lambda set_to_none=True: None)  # keep the gradient
    before = reset_peak()
    tr.optimize(rollout, torch.linspace(-1, 1, len(rollout)))
    train_peak = rss_kib("VmHWM") - before
    if spec.get("grads"):
        torch.save([p.grad for p in tr.params], spec["grads"])
    prompt = rollout.extras.get("completion_ids")
    return {"rollout_rows": len(rollout), "trained_actions": int(rollout.action_mask.sum()),
            "completion_tokens": int(prompt.shape[1]) if prompt is not None else 0,
            "sample_peak_mib": sample_peak / 1024, "train_peak_mib": train_peak / 1024}


def measure(config: str, overrides: list[str], threads: int = 1, grads: str | None = None,
            resample_whole: bool = False, repeats: int = 1) -> dict:
    """Peak MiB added by sampling one rollout and by one training pass over it (one minibatch), in a new process;
    with repeats > 1, each peak is the smallest over that many new processes: what a process's allocator keeps
    beyond the live tensors varies from one process to the next and only adds."""
    spec = {"config": config, "overrides": overrides, "threads": threads, "grads": grads,
            "resample_whole": resample_whole}
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-m", "mmrl.testing.memory", json.dumps(spec)], capture_output=True,
                             text=True)
        if out.returncode:
            raise RuntimeError(f"memory measurement failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {**runs[0], **{k: min(r[k] for r in runs) for k in ("sample_peak_mib", "train_peak_mib")}}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
