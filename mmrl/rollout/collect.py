"""One iteration's rollout: this rank's whole groups sampled and scored, with global group ids (several processes:
mmrl/parallel/distributed.py). DAPO dynamic sampling decides from every rank's groups, so all ranks decide alike; reward
overlap workers score a chunk while the next one samples.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from mmrl.algorithms import OFFPOLICY
from mmrl.algorithms.advantages import group_stats
from mmrl.data import Rollout
from mmrl.rollout.contrast import contrast_rollout
from mmrl.seeds import derive_seed


class Collector:
    """`collector(rng, gen) -> (rollout, rewards, valid, metrics)`: B groups of the task's prompts (this rank's share),
    sampled by the policy and scored by the reward runner."""

    def __init__(self, cfg, policy, task, reward, dist, timer):
        self.cfg, self.policy, self.task, self.reward, self.dist, self.timer = cfg, policy, task, reward, dist, timer
        self.reward_pool = ThreadPoolExecutor(cfg.reward.workers, "reward") if cfg.reward.workers else None

    def close(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        getattr(self.policy, "close", lambda: None)()  # optional (PolicyDefaults): a plugin policy may lack it

    def __call__(self, rng: random.Random, gen: torch.Generator, iteration: int | None = None):
        """`collect` (below), with the rollout counts the policy reports (rollout/video_tokens_mean, _max: every
        rank's prompts). iteration: the trainer's; when the task draws from its rng alone (`samples_ahead`), the next
        iteration's examples (drawn as the trainer will: rng seeded derive_seed(seed, "iteration", it + 1)) start
        loading their media in the background now, so their videos decode while this iteration samples."""
        t = self.cfg.train
        if iteration is not None and iteration + 1 < t.iterations and getattr(self.task, "samples_ahead", False):
            ahead = random.Random(derive_seed(t.seed, "iteration", iteration + 1))
            self.prefetch(self.task.sample(t.prompts_per_iter, ahead))
        rollout, rewards, valid, metrics = self.collect(rng, gen)
        for name, counts in sorted(getattr(self.policy, "rollout_counts", dict)().items()):
            counts = self.dist.gather_list(counts)
            if counts:
                metrics[f"rollout/{name}_mean"] = sum(counts) / len(counts)
                metrics[f"rollout/{name}_max"] = max(counts)
        return rollout, rewards, valid, metrics

    def prefetch(self, examples: list[dict]) -> None:
        """Start loading the media of this rank's share of a whole batch `examples` (Distributed.sample's groups)."""
        if hasattr(self.policy, "prefetch"):
            self.policy.prefetch([examples[i] for i in self.dist.share(len(examples))])

    def collect(self, rng: random.Random, gen: torch.Generator):
        """Sample B groups and score them: this rank's whole groups, with global group ids. With
        algo.dynamic_sampling (DAPO), groups whose rewards have zero std are replaced by freshly sampled ones for up
        to dynamic_sampling_tries extra rounds (zero-std groups fill what is still missing, so the batch always
        holds B groups). The choice is made from every rank's groups in the single-process order, so every rank
        takes the same decision; a rank left without a chosen group keeps one padding row (group id -1, never
        trained, never counted). A round of fewer groups than ranks (a refill) leaves some ranks without a group:
        they sample a padding copy all the same (Distributed.sample), so every rank runs the same forwards."""
        t, a = self.cfg.train, self.cfg.algo
        rounds = 1 + (a.dynamic_sampling_tries if a.dynamic_sampling else 0)
        good, spare, parts, failures, pad = [], [], {}, 0, None
        for r in range(rounds):
            need = t.prompts_per_iter - len(good)
            if need <= 0:
                break
            rollout, rewards, valid, fails = self.sample_and_score(self.task.sample(need, rng), gen)
            failures += fails
            pad = (rollout, rewards, valid)  # a row for padding when this rank keeps no group
            if not a.dynamic_sampling:
                return rollout, rewards, valid, {"reward/failed_samples": self.total(fails)}
            _, std, _ = group_stats(rewards["overall"], rollout.group_id, valid)
            mine = []
            for g in torch.unique(rollout.group_id).tolist():
                if g < 0:  # this rank's padding row (no group of this round)
                    continue
                rows = (rollout.group_id == g).nonzero().squeeze(-1)
                parts[(r, g)] = (rollout.select(rows), {k: v[rows] for k, v in rewards.items()}, valid[rows])
                mine.append((g, bool(std[rows].max() > 1e-8)))
            for g, informative in sorted(self.dist.gather_list(mine)):  # every rank's groups, in order
                (good if informative else spare).append((r, g))
        n_good = len(good)
        chosen = [(k, parts[key]) for k, key in enumerate((good + spare)[:t.prompts_per_iter]) if key in parts]
        if not chosen:  # padding: one row of this rank's last sample, masked out
            ro, rw, v = pad
            chosen = [(-1, (ro.select(torch.tensor([0])), {k: x[:1] for k, x in rw.items()}, v[:1] & False))]
        rollout = Rollout.concat([p[0] for _, p in chosen])
        rollout.group_id = torch.cat([torch.full((len(p[0]),), k) for k, p in chosen])   # global ids
        rewards = join_rewards([p[1] for _, p in chosen])
        valid = torch.cat([p[2] for _, p in chosen])
        return rollout, rewards, valid, {"reward/failed_samples": self.total(failures), "dynamic/rounds": r + 1,
                                         "dynamic/informative_groups": min(n_good, t.prompts_per_iter)}

    def contrast(self, rollout: Rollout, seed: int) -> tuple[tuple, dict]:
        """A contrast rollout of this iteration's prompts, for a reward shaping that compares against one
        (`needs_contrast`, e.g. T-GRPO: the same prompts with shuffled frames; mmrl/rollout/contrast.py): sampled
        like a rollout (every rank its share, padded to equal forwards), scored, never trained. Returns ((every
        rank's contrast rewards [M], their group ids [M]), mean statistics)."""
        t = self.cfg.train

        def sample(examples, group_size):
            with self.timer("rollout"), self.dist.autocast(t.mixed_precision, self.policy):
                return self.dist.sample(self.policy, examples, group_size,
                                        torch.Generator().manual_seed(derive_seed(t.seed, "contrast", seed)))

        (reward, gid), stats = contrast_rollout(sample, self.reward, rollout, t.group_size, seed, self.dist.gather_list)
        return (self.dist.gather(reward), self.dist.gather(gid)), self.dist.mean_stats(stats)

    def total(self, n: int) -> int:
        """The sum of every rank's n."""
        return sum(self.dist.gather_list([n]))

    def sample_and_score(self, examples: list[dict], gen: torch.Generator):
        """Sample a group per example and score it (this rank's groups; group ids are the examples' indices).
        With reward.workers > 0 the examples are sampled in reward.overlap_chunks chunks, and each chunk is scored
        in the thread pool while the next one samples (a remote reward then runs fully in parallel); the chunks
        are joined in order, and a rank samples the groups of each chunk that its share of the whole batch holds.
        A rank without a group here gets back one padding row (group id -1, reward 0, invalid), never scored."""
        a, r = self.cfg.algo, self.cfg.reward

        def sample(chunk, first_group):  # sampling computes like the training forward (bf16 under mixed precision)
            with self.timer("rollout"), self.dist.autocast(self.cfg.train.mixed_precision, self.policy):
                rollout = self.dist.sample(self.policy, chunk, self.cfg.train.group_size, gen, first_group,
                                           len(examples))
                # a padding row too: an injection's scoring forward is a collective under FSDP
                return OFFPOLICY[a.offpolicy](self.policy, rollout, self.task)[0]

        def padding(ro):  # (rollout, rewards, valid, failures) of a rank without a group: its padding row
            return ro, {"overall": torch.zeros(len(ro))}, torch.zeros(len(ro), dtype=torch.bool), 0

        if self.reward_pool is None:
            rollout = sample(examples, 0)
            if not len(real_rows(rollout)):
                return padding(rollout)
            with self.timer("reward"):
                return (rollout, *self.reward(rollout.outputs, rollout.examples, rollout.group_id))
        k = min(r.overlap_chunks, len(examples))
        bounds = [len(examples) * c // k for c in range(k + 1)]
        parts = []
        for c in range(k):
            ro = sample(examples[bounds[c]:bounds[c + 1]], bounds[c])
            real = len(real_rows(ro))  # a chunk without a group of this rank: nothing to score
            parts.append((ro, self.reward_pool.submit(self.reward, ro.outputs, ro.examples, ro.group_id) if real
                          else None))
        with self.timer("reward_wait"):  # the reward time not hidden behind sampling
            scored = [(ro, f.result()) for ro, f in parts if f is not None]
        if not scored:
            return padding(parts[-1][0])
        rollout = Rollout.concat([ro for ro, _ in scored])
        rollout.group_id = torch.cat([ro.group_id for ro, _ in scored])  # global ids, not renumbered
        rewards = join_rewards([s[0] for _, s in scored])
        return rollout, rewards, torch.cat([s[1] for _, s in scored]), sum(s[2] for _, s in scored)


def real_rows(rollout: Rollout) -> torch.Tensor:
    """[n] the rows of `rollout` that belong to a group (a padding row has group id -1)."""
    return (rollout.group_id >= 0).nonzero().squeeze(-1)


def join_rewards(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate the reward dicts {key: [n_i]} of consecutive parts. A part whose reward failed on every sample
    has only "overall" (its rows are invalid): its other keys are zeros, so the valid rows of the other parts keep
    every component (gdpo / batch aggregation read them by name)."""
    keys = sorted({k for p in parts for k in p})
    return {k: torch.cat([p[k] if k in p else torch.zeros(len(p["overall"])) for p in parts]) for k in keys}

