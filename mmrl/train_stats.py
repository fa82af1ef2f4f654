"""The training passes' statistics, kept as (sum, count) pairs so that every rank's passes add up to one set of
numbers (the single-process ones): `Distributed.mean_stats` divides the summed sums by the summed counts. The sums
stay on the device where the passes computed them, read once per iteration (no host sync per pass)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class PassStats:
    """Per-action statistics of one iteration's training passes: `add` after each backward, `summary` once."""

    def __init__(self):
        self.stats: dict[str, list[tuple]] = {}  # key -> [(sum, count)], each a number or a 0-d tensor
        self.ratios: list[tuple[torch.Tensor, torch.Tensor]] = []  # per pass: (ratio sum [A], action count [A])

    def put(self, key: str, total: float | torch.Tensor, count: int | torch.Tensor) -> None:
        self.stats.setdefault(key, []).append((total, count))

    def add(self, key: str, values: torch.Tensor, where: torch.Tensor) -> None:
        """A per-action statistic [n, A], summed over the actions of `where` [n, A] (on the device)."""
        where = where.to(values.device)
        self.put(key, torch.where(where, values.detach().float(), 0.0).sum(), where.sum())

    def on_host(self) -> dict[str, list[tuple[float, int]]]:
        """{key: [(sum, count)]} as numbers: the device's sums read in one transfer."""
        keys = list(self.stats)
        parts = [x for k in keys for pair in self.stats[k] for x in pair]
        dev = next((x.device for x in parts if isinstance(x, torch.Tensor)), torch.device("cpu"))
        flat = torch.stack([torch.as_tensor(x, dtype=torch.float64).to(dev) for x in parts]).tolist() if parts else []
        out, i = {}, 0
        for k in keys:
            pairs = []
            for _ in self.stats[k]:
                pairs.append((flat[i], int(flat[i + 1])))
                i += 2
            out[k] = pairs
        return out

    def add_pass(self, out, mb, s: dict, part: torch.Tensor, first: bool) -> None:
        """One pass: the objective's statistics `s` ([n, A], or (values, mask)), the policy's own per-action ones
        (out.stats, e.g. token entropy), the approximate KL to the rollout, the engine's ratio (TIS) and, before the
        first optimizer step (`first`), the rollout's log-probs against the trainer's under the same weights."""
        lp, old = out.log_prob.detach(), mb.old_log_prob
        if first:  # 0 unless they disagree (sampling engine, precision, nondeterminism)
            self.add("first_ratio_dev", (torch.exp(lp - old) - 1).abs(), part)
        for k, v in s.items():
            if isinstance(v, tuple):
                if v[1].any():
                    self.add(k, *v)
            else:
                self.add(k, v, part)
        if "rollout_log_prob" in mb.extras:  # the engine's log-probs against the trainer's old ones (TIS's ratio)
            engine = mb.extras["rollout_log_prob"].to(lp.device)
            known = torch.isfinite(engine) & part
            if known.any():
                self.add("engine_ratio_dev", (torch.exp(old - engine) - 1).abs(), known)
        self.add("approx_kl", 0.5 * (lp - old) ** 2, part)
        for k, v in out.stats.items():
            if v.shape == out.log_prob.shape:
                self.add(f"policy_{k}", v, part)
        self.ratios.append(((s["ratio"] * part).sum(0), part.sum(0)))

    def summary(self, dist, labels: torch.Tensor | None) -> dict[str, float]:
        """Every rank's statistics merged: train/<key>, and ratio_per_action/<step> (labels [N, A]: a flow policy's
        step index per action; token policies: the position)."""
        out = {f"train/{k}": v for k, v in dist.mean_stats(self.on_host()).items()}
        out["train/clip_frac"] = out.pop("train/clipped", 0.0)
        out["train/ratio_mean"] = out.pop("train/ratio", 1.0)
        r = self.ratios
        sums = dist.gather_list([(torch.stack([x for x, _ in r]).sum(0).tolist(),
                                  torch.stack([c for _, c in r]).sum(0).tolist())] if r else [])
        width = max((len(x) for x, _ in sums), default=0)  # token policies: completions differ in length
        for j in range(width):
            total = sum(x[j] for x, _ in sums if j < len(x))
            count = max(sum(c[j] for _, c in sums if j < len(c)), 1)
            name = int(labels[0, j]) if labels is not None and j < labels.shape[1] else j
            out[f"ratio_per_action/{name}"] = total / count
        return out

    @staticmethod
    def warn(out: dict, ratio_warn: float, iteration: int) -> None:
        """A warning when the first pass's |ratio - 1| exceeds train.ratio_warn."""
        if out.get("train/first_ratio_dev", 0.0) > ratio_warn > 0:
            log.warning("iteration %d: the first pass's |ratio - 1| is %.3g (train.ratio_warn=%g): the rollout's log-probs "
                        "differ from the trainer's under the same weights (sampling engine, precision, nondeterminism)",
                        iteration, out["train/first_ratio_dev"], ratio_warn)
