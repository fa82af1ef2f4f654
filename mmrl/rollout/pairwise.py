"""Pref-GRPO pairwise rewards (docs/algorithms.md §6): every group's C(G,2) pairs go to a pairwise judge, and
each sample's reward is its win rate. The advantage estimator then z-scores the win rates as usual.

A judge is a callable `(outputs_a, outputs_b, examples) -> Tensor[P]` over P pairs, batched: +1 when a is better,
-1 when b is better, 0 for a tie or an unparseable answer, NaN when the comparison failed. outputs_* are rows of
the rollout's outputs (images [P, 3, H, W] or P strings); examples[p] is the pair's prompt. Registry: JUDGES.

    w_i = (wins_i + 0.5 * ties_i) / (comparisons of i that did not fail)      (= wins / (G - 1) with no failures)
"""

from __future__ import annotations

import logging

import torch

from mmrl.registry import Registry

log = logging.getLogger(__name__)
# name -> factory `(**judge_kwargs) -> judge`; a judge that wraps a reward takes it built (mmrl/compose.py)
JUDGES = Registry("pairwise judge", {"score": "mmrl.rollout.pairwise:ScoreJudge", "vlm": "rewards.judges:VLMJudge"})


def all_pairs(group_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (i [P], j [P]) of every unordered pair i < j of samples that share a group: P = sum_g C(G_g, 2)."""
    same = (group_id[:, None] == group_id[None, :]).triu(diagonal=1)  # [N, N]
    i, j = same.nonzero(as_tuple=True)
    return i, j


def win_rates(verdict: torch.Tensor, i: torch.Tensor, j: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(win rate [N], comparisons counted [N]) from verdicts [P] in [-1, 1] (NaN = failed, not counted). A sample
    with no counted comparison gets NaN (the reward runner then marks it invalid)."""
    ok = torch.isfinite(verdict)
    v = torch.where(ok, verdict, torch.zeros_like(verdict)).double()
    w = ok.double()
    wins = torch.zeros(n, dtype=torch.float64).index_add_(0, i, w * (1 + v) / 2).index_add_(0, j, w * (1 - v) / 2)
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, i, w).index_add_(0, j, w)
    rate = torch.where(count > 0, wins / count.clamp(min=1), torch.full_like(wins, float("nan")))
    return rate.float(), count.float()


def _take(outputs, idx: torch.Tensor):
    return outputs[idx] if isinstance(outputs, torch.Tensor) else [outputs[k] for k in idx.tolist()]


class PairwiseReward:
    """A reward `(outputs, examples, group_id) -> {"overall": win rate, "tie_rate", "comparisons"}` from a judge.

    batch_size: pairs per judge call. symmetric: judge each pair in both orders and average (cancels a judge's
    position bias at twice the cost). A judge call that raises is retried pair by pair; pairs that still fail
    are NaN and excluded from the win rates (and counted in `failed_pairs`).
    """

    needs_groups = True  # the reward runner passes group_id and never re-scores samples one by one

    def __init__(self, judge="score", batch_size: int = 64, symmetric: bool = False):
        """judge: the judge object, built by mmrl.compose from the config's `judge` name and `judge_kwargs`."""
        self.judge, self.batch_size, self.symmetric = judge, batch_size, symmetric
        self.failed_pairs = 0

    def compare(self, outputs, examples: list, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Verdicts [P] for the pairs (i, j), in batches of batch_size. A judge built on a pointwise score
        (`score` + `verdict`) scores each sample once, not once per pair it takes part in (G - 1 times)."""
        if hasattr(self.judge, "score"):
            try:
                scores = self.judge.score(outputs, examples)                          # [N]
                return self.judge.verdict(scores[i], scores[j])  # antisymmetric: symmetric averaging changes nothing
            except Exception as e:  # noqa: BLE001 - pair by pair below, so only the failing pairs are lost
                log.warning("score judge raised on %d samples (%s: %s); judging pairs", len(examples), type(e).__name__, e)
        out = []
        for s in range(0, len(i), self.batch_size):
            a, b = i[s:s + self.batch_size], j[s:s + self.batch_size]
            v = self._judge(outputs, examples, a, b)
            if self.symmetric:
                v = (v - self._judge(outputs, examples, b, a)) / 2
            out.append(v)
        return torch.cat(out) if out else torch.zeros(0)

    def _judge(self, outputs, examples, a, b) -> torch.Tensor:
        ex = [examples[k] for k in a.tolist()]
        try:
            return self._check(self.judge(_take(outputs, a), _take(outputs, b), ex), len(a))
        except Exception as e:  # noqa: BLE001 - find the failing pairs below
            log.warning("judge raised on %d pairs (%s: %s); judging them one by one", len(a), type(e).__name__, e)
        res = []
        for p in range(len(a)):
            try:
                res.append(self._check(self.judge(_take(outputs, a[p:p + 1]), _take(outputs, b[p:p + 1]), ex[p:p + 1]), 1))
            except Exception as e:  # noqa: BLE001
                log.warning("judge raised on pair (%d, %d): %s: %s", int(a[p]), int(b[p]), type(e).__name__, e)
                self.failed_pairs += 1
                res.append(torch.tensor([float("nan")]))
        return torch.cat(res)

    @staticmethod
    def _check(v, p: int) -> torch.Tensor:
        v = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        if v.shape[0] != p:
            raise ValueError(f"a judge must return one verdict per pair: got {v.shape[0]} for {p} pairs")
        bad = torch.isfinite(v) & (v.abs() > 1)
        if bad.any():
            raise ValueError(f"judge verdicts must be in [-1, 1] (+1: first better, -1: second, 0: tie); got {v[bad][:3].tolist()}")
        return v

    def __call__(self, outputs, examples: list, group_id: torch.Tensor) -> dict[str, torch.Tensor]:
        n = len(examples)
        i, j = all_pairs(group_id)
        v = self.compare(outputs, examples, i, j)
        rate, count = win_rates(v, i, j, n)
        tie = (v == 0).double()
        ties = torch.zeros(n, dtype=torch.float64).index_add_(0, i, tie).index_add_(0, j, tie)
        return {"overall": rate, "tie_rate": (ties / count.clamp(min=1)).float(), "comparisons": count}


class ScoreJudge:
    """A pointwise reward turned into a judge: compare `key` scores; |difference| <= margin is a tie."""

    def __init__(self, reward="shapes", key: str = "overall", margin: float = 0.0):
        """reward: the reward object, built by mmrl.compose from the config's `reward` name and `reward_kwargs`."""
        self.reward, self.key, self.margin = reward, key, margin

    def score(self, outputs, examples) -> torch.Tensor:
        return torch.as_tensor(self.reward(outputs, examples)[self.key], dtype=torch.float32)

    def verdict(self, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        """+1 / -1 / 0 from two scores; a NaN score gives NaN (the pair is not counted)."""
        d = sa - sb
        return torch.where(d.abs() <= self.margin, torch.zeros_like(d), d.sign())

    def __call__(self, outputs_a, outputs_b, examples) -> torch.Tensor:
        return self.verdict(self.score(outputs_a, examples), self.score(outputs_b, examples))


class RuleJudge:
    """A rule `(output_a, output_b, example) -> +1 | -1 | 0` turned into a batched judge."""

    def __init__(self, rule):
        self.rule = rule

    def __call__(self, outputs_a, outputs_b, examples) -> torch.Tensor:
        return torch.tensor([float(self.rule(a, b, e)) for a, b, e in zip(outputs_a, outputs_b, examples)])
