"""Logging: TensorBoard event files (offline) + a JSONL copy of every scalar, image grids with prompts,
completion tables for token policies."""

from __future__ import annotations

import json
import logging
import os
import time

import torch

log = logging.getLogger(__name__)


def video_strips(videos: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """[N, 3, F, H, W] -> [N, 3, H, F' * W]: F' <= max_frames evenly spaced frames side by side."""
    f = videos.shape[2]
    idx = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    return videos[:, :, idx].permute(0, 1, 3, 2, 4).flatten(3)


class Logger:
    """metrics.jsonl (every scalar, one JSON line per call) and TensorBoard under `out_dir`.

    resume: (lines, step) of the checkpoint a resumed run starts from: metrics.jsonl is cut back to the `lines`
    lines written before that checkpoint (what a killed run logged after it goes), and TensorBoard drops its
    events from `step` on (purge_step), then gets the kept lines at or after `step` again (an evaluation logged
    just before the save). No step is ever logged twice."""

    def __init__(self, out_dir: str, tensorboard: bool = True, enabled: bool = True,
                 resume: tuple[int, int] | None = None, report_to: list[str] = (), config=None):
        self.jsonl = self.tb = None
        self.lines = 0  # lines in metrics.jsonl (saved with each checkpoint)
        if not enabled:  # ranks other than 0 of a multi-process run log nothing
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = _truncate_lines(path, resume[0], resume[1]) if resume else []
        self.lines = len(kept) if resume else _count_lines(path)
        self.jsonl = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=resume[1] if resume else None)
            for row in kept:
                if row.get("step", -1) >= resume[1]:
                    for k, v in row.items():
                        if k not in ("step", "time"):
                            self.tb.add_scalar(k, v, row["step"])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        values = {k: float(v) for k, v in values.items()}
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self.jsonl.flush()
        self.lines += 1
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def samples(self, step: int, outputs, examples: list[dict], rewards: torch.Tensor, group_size: int,
                limit: int = 32) -> None:
        """The first `limit` samples of a rollout: an image grid / video strips with their prompts (one group per
        row), or a table of completions with prompts and rewards."""
        k = min(len(examples), limit)
        prompts = [e["prompt"] for e in examples[:k]]
        if isinstance(outputs, torch.Tensor):
            self.images(step, "samples", outputs[:k], prompts, nrow=group_size)
        else:
            self.texts(step, "samples", prompts, list(outputs[:k]), rewards[:k].tolist())

    def images(self, step: int, tag: str, images: torch.Tensor, captions: list[str], nrow: int = 8) -> None:
        """images [N, 3, H, W] in [-1, 1] -> one grid image, and the captions in grid order as text.
        Videos [N, 3, F, H, W] become strips of at most 8 evenly spaced frames, one video per row."""
        if not self.tb:
            return
        from torchvision.utils import make_grid

        if images.dim() == 5:
            images, nrow = video_strips(images), 1
        grid = make_grid((images.detach().float().cpu().clamp(-1, 1) + 1) / 2, nrow=nrow, padding=1, pad_value=1.0)
        self.tb.add_image(tag, grid, step)
        rows = [" | ".join(captions[i:i + nrow]) for i in range(0, len(captions), nrow)]
        self.tb.add_text(tag + "/prompts", "  \n".join(f"row {r}: {t}" for r, t in enumerate(rows)), step)

    def texts(self, step: int, tag: str, prompts: list[str], outputs: list[str], rewards: list[float]) -> None:
        """Completions with their prompts and rewards, as one markdown table."""
        if not self.tb:
            return
        esc = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        rows = [f"| {esc(p)} | {esc(o)} | {r:.3f} |" for p, o, r in zip(prompts, outputs, rewards)]
        self.tb.add_text(tag, "\n".join(["| prompt | completion | reward |", "|---|---|---|"] + rows), step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _count_lines(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _truncate_lines(path: str, n: int | None, step: int) -> list[dict]:
    """Cut the JSONL file at `path` back to its first n lines (a partial last line of a killed run goes too);
    n None (a checkpoint from before the count was saved): the lines logged before `step`. Returns them parsed."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = [ln for ln in f.readlines() if ln.endswith(b"\n")]
    lines = lines[:n] if n is not None else [ln for ln in lines if json.loads(ln).get("step", 0) < step]
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    return [json.loads(ln) for ln in lines]


def perf(t, seconds: float) -> dict:
    """Samples per second of an iteration, and the accelerator's peak memory so far (GiB) where there is one."""
    out = {"perf/iteration_s": seconds, "perf/samples_per_s": t.prompts_per_iter * t.group_size / max(seconds, 1e-9)}
    if torch.cuda.is_available():
        out["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class Timer:
    """Accumulates wall time per phase: `with timer("rollout"): ...`; `timer.pop()` -> {"time/rollout": s}."""

    def __init__(self):
        self.t: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.t[name] = timer.t.get(name, 0.0) + time.perf_counter() - self.t0

        return _Ctx()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.t.items()}
        self.t = {}
        return out


def per_category(examples: list[dict], rewards: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """{"reward_by_category/<c>": mean reward of the valid samples whose example has category c}."""
    cats = [e.get("category") for e in examples]
    out = {}
    for c in sorted({c for c in cats if c}):
        m = torch.tensor([x == c for x in cats]) & valid
        if m.any():
            out[f"reward_by_category/{c}"] = rewards[m].mean().item()
    return out


class SignalWatch:
    """No run goes on training on nothing: an iteration whose failed rewards exceed reward.max_failed_fraction
    stops the run, naming the reward and the fix; advantages that stay all zero (constant rewards in every
    group) are warned about every `patience` iterations (train.zero_signal_patience)."""

    def __init__(self, reward_cfg, task_name: str, patience: int):
        self.reward_cfg, self.task_name, self.patience = reward_cfg, task_name, patience
        self.zero_iters = 0  # iterations in a row whose advantages were all zero

    def __call__(self, valid: torch.Tensor, adv: torch.Tensor, last_error: str | None) -> None:
        r, n = self.reward_cfg, len(valid)
        failed = int((~valid).sum())
        if failed > r.max_failed_fraction * n:
            raise RuntimeError(
                f"reward {r.name!r} failed on {failed} of {n} samples this iteration (reward.max_failed_fraction="
                f"{r.max_failed_fraction}); last error: {last_error or 'NaN/inf scores'}. Fix: use a reward that "
                f"scores this task's outputs (task.name={self.task_name!r}), fix the reward's inputs, or raise "
                f"reward.max_failed_fraction to tolerate it")
        self.zero_iters = self.zero_iters + 1 if not bool((adv[valid] != 0).any()) else 0
        if self.patience and self.zero_iters >= self.patience and self.zero_iters % self.patience == 0:
            log.warning("NO LEARNING SIGNAL: every advantage has been 0 for %d iterations (each group's rewards are "
                        "equal). Check the reward on these outputs, raise train.group_size or sampler.noise_level, or "
                        "set algo.dynamic_sampling=true", self.zero_iters)
