"""The one training loop. It knows nothing about modalities: a policy samples a Rollout and recomputes
log-probs [n, A]; everything else here (advantages, ratio, clipping, KL, weights, aggregation, optimizer,
logging, checkpoints) is shared by every policy.

    for each iteration:
        examples <- task.sample(B)                        rollout <- policy.sample(examples, G)
        rewards, valid <- reward(rollout.outputs)         adv <- ADVANTAGES[algo.advantage](rewards, group_id)
        for inner epochs, minibatches:  logp <- policy.log_prob(rollout, mb);  loss; backward; (accumulate) step
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from mmrl import checkpoint as ckpt
from mmrl import compose
from mmrl.algorithms import (ADVANTAGES, CREDIT_ASSIGNMENTS, KL_ESTIMATORS, LOSS_AGG, OFFPOLICY, POLICY_LOSSES,
                             RATIO_TRANSFORMS, REWARD_SHAPINGS, WEIGHTINGS)
from mmrl.algorithms.advantages import group_stats
from mmrl.algorithms.offpolicy import injection_diagnostics
from mmrl.config import Config
from mmrl.data import Rollout, micro_batches
from mmrl.distributed import Distributed, full
from mmrl.evaluation import evaluate_outputs
from mmrl.metrics import Logger, SignalWatch, Timer, per_category
from mmrl.rollout.contrast import contrast_rollout
from mmrl.optim import EMA, lr_scale
from mmrl.reward import RewardRunner

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = compose.check_choices(cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.dist = Distributed(cfg.train.parallel)
        torch.manual_seed(cfg.train.seed)  # the same initial weights (and LoRA init) on every rank
        self.policy = compose.build_policy(cfg)
        if cfg.train.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        if self.dist.world > 1:
            self.dist.check_config(cfg)
            self.policy.parallelize(lambda m: self.dist.wrap(m, cfg.train.mixed_precision), cfg.train.parallel)
        with self.dist.main_first():  # a task that writes its data (the grounding world) does it once
            self.task = compose.build_task(cfg.task)
        self.reward_fn = compose.build_reward(cfg.reward.name, cfg.reward.kwargs)
        self.reward = RewardRunner(self.reward_fn, cfg.reward.on_error, cfg.train.micro_batch)
        self.eval_reward = self.reward if not cfg.reward.eval_name else RewardRunner(
            compose.build_reward(cfg.reward.eval_name, cfg.reward.eval_kwargs, "reward.eval"), cfg.reward.on_error,
            cfg.train.micro_batch)
        self.credit = CREDIT_ASSIGNMENTS[compose.credit_name(cfg)]
        self.reward_pool = ThreadPoolExecutor(cfg.reward.workers, "reward") if cfg.reward.workers else None
        self.params = list(self.policy.trainable_parameters())
        if not self.params:
            raise ValueError("the policy has no trainable parameters (check model.lora settings)")
        self.opt = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.ema = EMA(self.params, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        self.iteration = 0
        self.watch = SignalWatch(cfg.reward, cfg.task.name, cfg.train.zero_signal_patience)
        self.timed_evals: list[dict] = []
        self.elapsed_min = 0.0  # training minutes so far (saved: a resumed run keeps its budget and lr schedule)
        # One optimizer step per epoch: every row's first forward runs under the sampling weights, so the
        # rollout's old log-probs are that forward's (detached) values; policies that must pay an extra
        # forward for them (token policies) skip it.
        self.policy.defer_old_log_prob = cfg.train.minibatches == cfg.train.grad_accum
        self.logger = Logger(cfg.log.out_dir, cfg.log.tensorboard, enabled=self.dist.main)
        self.timer = Timer()

    # ------------------------------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        results = {}
        if cfg.log.eval_at_start and self.iteration == 0:
            results["eval_start"] = self.evaluate(0)
        t_start = time.time() - 60 * self.elapsed_min  # a resumed run continues its time budget
        bar = tqdm(range(self.iteration, t.iterations), desc="train", disable=not cfg.log.progress,
                   initial=self.iteration, total=t.iterations)
        for it in bar:
            self.iteration = it
            lr = t.lr * lr_scale(it, t.iterations, self.elapsed_min, t.time_budget_min, t.lr_warmup, t.lr_cooldown)
            for g in self.opt.param_groups:
                g["lr"] = lr
            metrics = self.step(it)
            metrics["train/lr"] = lr
            self.iteration = it + 1
            self.elapsed_min = (time.time() - t_start) / 60
            bar.set_postfix(reward=f"{metrics['reward/overall_mean']:.3f}")
            self.logger.scalars(it, metrics)
            out_of_time = t.time_budget_min > 0 and self.elapsed_min >= t.time_budget_min
            last = self.iteration == t.iterations or out_of_time
            timed = cfg.log.eval_every_min and self.elapsed_min >= cfg.log.eval_every_min * (1 + len(self.timed_evals))
            if (cfg.log.eval_every and self.iteration % cfg.log.eval_every == 0 or timed) and not last:
                res = self.evaluate(self.iteration)
                if timed:
                    self.timed_evals.append({"minutes": self.elapsed_min, "iteration": self.iteration, **res})
            if self.iteration % cfg.log.save_every == 0 or last:
                self.save()
            if out_of_time:
                log.warning("train.time_budget_min=%s reached after %d iterations", t.time_budget_min, self.iteration)
                break
        results["eval_end"] = self.evaluate(self.iteration)
        results["eval_timed"] = self.timed_evals  # log.eval_every_min: [{minutes, iteration, metrics...}]
        results["iterations"] = self.iteration
        with open(os.path.join(cfg.log.out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        self.logger.close()
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        return results

    def step(self, it: int) -> dict:
        cfg, t, a = self.cfg, self.cfg.train, self.cfg.algo
        seed = t.seed * 1_000_003 + it  # per-iteration seeds: resuming needs no RNG state
        torch.manual_seed(seed)
        self.policy.iteration = it  # schedules that move with training (sampler.window_schedule=sliding)
        rollout, rewards, valid, metrics = self._collect(random.Random(seed), torch.Generator().manual_seed(seed))
        metrics["rollout/actions_mean"] = rollout.action_mask.sum(-1).float().mean().item()  # tokens: completion length
        local = (rollout, valid)
        if self.dist.world > 1:  # advantages need whole groups: every rank sees every row's reward
            rollout, rewards, valid, self._local_rows, self._row_actions = self.dist.gather_rows(rollout, rewards, valid)
        shaping, extra = REWARD_SHAPINGS[a.reward_shaping], ()
        if getattr(shaping, "needs_contrast", False):  # e.g. T-GRPO: the same prompts with shuffled frames
            sample = lambda ex, g: self.policy.sample(ex, g, torch.Generator().manual_seed(seed + 1))  # noqa: E731
            contrast, stats = contrast_rollout(sample, self.reward, rollout, t.group_size, seed)
            extra = (contrast,)
            metrics.update(stats)
        shaped = shaping(rewards["overall"], a, *extra)
        adv, adv_stats = self.credit({**rewards, "overall": shaped}, getattr(self.reward_fn, "weights", None), rollout,
                                     valid, cfg, it)  # [N] or [N, A] (tree rollouts: per transition)
        adv_fn = lambda r, g, v: ADVANTAGES[a.advantage](r, g, v, a)[0]  # noqa: E731
        self.watch(valid, adv, self.reward.last_error)
        rollout.action_mask &= valid.unsqueeze(-1)
        metrics.update({f"reward/{k}_mean": v[valid].mean().item() if valid.any() else 0.0 for k, v in rewards.items()})
        metrics["reward/overall_std"] = rewards["overall"][valid].std().item() if valid.sum() > 1 else 0.0
        metrics.update(adv_stats)
        metrics.update(injection_diagnostics(shaped, rollout.group_id, valid, rollout.is_offpolicy, adv_fn))
        metrics.update(per_category(rollout.examples, rewards["overall"], valid))
        if self.dist.world > 1:  # back to this rank's rows
            (rollout, valid), adv = local, adv[self._local_rows]
            rollout.action_mask &= valid.unsqueeze(-1)
        with self.timer("train"):
            metrics.update(self.optimize(rollout, adv))
        metrics.update(self.timer.pop())
        if cfg.log.image_every and it % cfg.log.image_every == 0:
            self.logger.samples(it, rollout.outputs, rollout.examples, rewards["overall"], t.group_size)
        return metrics

    def _collect(self, rng: random.Random, gen: torch.Generator):
        """Sample B groups and score them. With algo.dynamic_sampling (DAPO), groups whose rewards have zero
        std are replaced by freshly sampled ones for up to dynamic_sampling_tries extra rounds (zero-std groups
        fill what is still missing, so the batch always holds B groups)."""
        t, a = self.cfg.train, self.cfg.algo
        rounds = 1 + (a.dynamic_sampling_tries if a.dynamic_sampling else 0)
        good, spare, failures = [], [], 0
        for r in range(rounds):
            need = t.prompts_per_iter - sum(len(torch.unique(g[0].group_id)) for g in good)
            if need <= 0:
                break
            rollout, rewards, valid, fails = self._sample_and_score(self.task.sample(need, rng), gen)
            failures += fails
            if not a.dynamic_sampling:
                return rollout, rewards, valid, {"reward/failed_samples": fails}
            _, std, _ = group_stats(rewards["overall"], rollout.group_id, valid)
            for g in torch.unique(rollout.group_id):
                rows = (rollout.group_id == g).nonzero().squeeze(-1)
                part = (rollout.select(rows), {k: v[rows] for k, v in rewards.items()}, valid[rows])
                (good if std[rows].max() > 1e-8 else spare).append(part)
        n_good = len(good)
        parts = (good + spare)[:t.prompts_per_iter]
        rollout = Rollout.concat([p[0] for p in parts])
        rewards = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
        valid = torch.cat([p[2] for p in parts])
        return rollout, rewards, valid, {"reward/failed_samples": failures, "dynamic/rounds": r + 1,
                                         "dynamic/informative_groups": min(n_good, t.prompts_per_iter)}

    def _sample_and_score(self, examples: list[dict], gen: torch.Generator):
        """Sample a group per example and score it. With reward.workers > 0 the examples are sampled in
        reward.overlap_chunks chunks, and each chunk is scored in the thread pool while the next one samples
        (a remote reward then runs fully in parallel); the chunks are joined in order."""
        a, r = self.cfg.algo, self.cfg.reward

        def sample(chunk):  # sampling computes like the training forward (bf16 under mixed precision)
            with self.timer("rollout"), self.dist.autocast(self.cfg.train.mixed_precision, self.policy):
                rollout = self.dist.sample(self.policy, chunk, self.cfg.train.group_size, gen)
                return OFFPOLICY[a.offpolicy](self.policy, rollout, self.task)[0]

        if self.reward_pool is None:
            rollout = sample(examples)
            with self.timer("reward"):
                return (rollout, *self.reward(rollout.outputs, rollout.examples, rollout.group_id))
        k = min(r.overlap_chunks, len(examples))
        bounds = [len(examples) * c // k for c in range(k + 1)]
        parts = []
        for c in range(k):
            ro = sample(examples[bounds[c]:bounds[c + 1]])
            parts.append((ro, self.reward_pool.submit(self.reward, ro.outputs, ro.examples, ro.group_id)))
        with self.timer("reward_wait"):  # the reward time not hidden behind sampling
            scored = [(ro, f.result()) for ro, f in parts]
        rollout = Rollout.concat([ro for ro, _ in scored])
        keys = set.intersection(*(set(s[0]) for _, s in scored))  # a per-sample retry may drop component keys
        rewards = {key: torch.cat([s[0][key] for _, s in scored]) for key in sorted(keys)}
        return rollout, rewards, torch.cat([s[1] for _, s in scored]), sum(s[2] for _, s in scored)

    def optimize(self, rollout: Rollout, adv: torch.Tensor) -> dict:
        if self.dist.world > 1:
            return self._optimize(rollout, adv, self._local_rows, self._row_actions)
        return self._optimize(rollout, adv, torch.arange(len(rollout)), rollout.action_mask.sum(-1))

    def _optimize(self, rollout: Rollout, adv: torch.Tensor, rows: torch.Tensor, row_actions: torch.Tensor) -> dict:
        """rows: the global indices of this rank's rows of the rollout; row_actions [N]: trained actions of every
        row (all ranks). Minibatches are chunks of one global permutation; each rank trains its rows of them,
        normalized by the whole step's counts (x world, as DDP / FSDP average the gradients over ranks)."""
        cfg, t, w = self.cfg, self.cfg.train, self.dist.world
        n_total, off = len(row_actions), int(rows[0]) if len(rows) else 0
        stats: dict[str, list] = {}
        ratios, steps = [], 0
        for epoch in range(t.inner_epochs):
            perm = torch.randperm(n_total, generator=torch.Generator().manual_seed(t.seed + 7919 * epoch + self.iteration))
            chunks = perm.tensor_split(t.minibatches)  # minibatches (uneven when N is not divisible)
            for m in tqdm(range(t.minibatches), desc=f"train epoch {epoch}", leave=False,
                          disable=not cfg.log.progress or t.minibatches == 1 or not self.dist.main):
                mine = chunks[m][(chunks[m] >= off) & (chunks[m] < off + len(rows))] - off  # local indices
                # a rank with no row in this minibatch still runs one (zero-weighted) forward and backward, so
                # every rank takes part in the same collectives
                idx, weight = (mine, 1.0) if len(mine) else (torch.tensor([0]), 0.0)
                # Normalize by the sizes of the optimizer step's whole batch (grad_accum minibatches): the
                # gradient of one step is that of its full-batch loss whatever the minibatch split.
                first = m - m % t.grad_accum
                step_rows = torch.cat(chunks[first:first + t.grad_accum])
                n_step, a_step = len(step_rows) / w, max(int(row_actions[step_rows].sum()), 1) / w
                for part, actions in micro_batches(rollout.action_mask, idx, t.micro_batch, self.policy.scores_actions):
                    self._accumulate(rollout, part, actions, adv, n_step, a_step, weight, steps, stats, ratios)
                if (m + 1) % t.grad_accum == 0:
                    stats.setdefault("grad_norm", []).append(
                        full(torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)).item())
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                    if self.ema is not None:
                        self.ema.update()
                    steps += 1
        out = {f"train/{k}": sum(v) / len(v) for k, v in stats.items()}
        out["train/clip_frac"] = out.pop("train/clipped", 0.0)
        out["train/ratio_mean"] = out.pop("train/ratio", 1.0)
        labels = rollout.extras.get("step_index")
        per_action = torch.stack([r for r, _ in ratios]).sum(0) / torch.stack([c for _, c in ratios]).sum(0).clamp(min=1)
        for j, r in enumerate(per_action.tolist()):
            out[f"ratio_per_action/{int(labels[0, j]) if labels is not None else j}"] = r
        out["train/optimizer_steps"] = steps
        if steps:  # an engine with its own weight copy (vLLM) reloads
            self.policy.sync_weights()
        return out

    def _accumulate(self, rollout, idx, actions, adv, n_step, a_step, weight, steps, stats, ratios) -> None:
        """Forward and backward of rows `idx` (only `actions` [n, A] when given) with the loss normalized by the
        optimizer step's sizes: the gradients of the parts add up to the gradient of the whole minibatch."""
        a = self.cfg.algo
        kw = {} if actions is None else {"actions": actions}
        if a.kl_coef > 0:  # before the forward with gradients: the EMA reference swaps the weights in place
            with torch.no_grad(), self.ema.swapped() if a.kl_reference == "ema" else self.policy.reference():
                ref = self.policy.log_prob(rollout, idx, **kw)
        with self.dist.autocast(self.cfg.train.mixed_precision, self.policy):
            out = self.policy.log_prob(rollout, idx, **kw)
        deferred = torch.isnan(rollout.old_log_prob[idx])
        if deferred.any():  # fill deferred old log-probs from this first forward (weights unchanged)
            if steps:
                raise RuntimeError("deferred old log-probs reached after an optimizer step")
            old = rollout.old_log_prob[idx]
            rollout.old_log_prob[idx] = torch.where(deferred, out.log_prob.detach().to(old), old)
        dev = out.log_prob.device  # the loss runs where the log-probs are; bookkeeping comes from CPU
        mb = rollout.select(idx).to(dev)
        logp = RATIO_TRANSFORMS[a.ratio](out.log_prob, mb.old_log_prob, mb, out)
        loss_fn = POLICY_LOSSES[a.policy_loss]  # forward-process losses (nft) read the velocities in `out` too
        loss_a, s = loss_fn(logp, mb.old_log_prob, adv[idx].to(dev), a, *((out,) if getattr(loss_fn, "needs_output",
                                                                                              False) else ()))
        if a.kl_coef > 0:
            kl = KL_ESTIMATORS[a.kl](out, ref)
            loss_a = loss_a + a.kl_coef * kl
            s["kl"] = kl.detach()
        for name in a.weighting.split("+"):
            loss_a = loss_a * WEIGHTINGS[name](mb, out)
        mask = mb.action_mask  # the whole rows' actions normalize the loss; this part's actions carry it
        part = mask if actions is None else mask & actions.to(dev)
        if a.sft_coef > 0:  # supervised anchor: NLL of the injected (off-policy) rows' actions
            inj = mb.is_offpolicy[:, None] & part  # [n, A]
            loss_a = loss_a - a.sft_coef * out.log_prob * inj
            if inj.any():
                stats.setdefault("sft_nll", []).append(-out.log_prob.detach()[inj].mean().item())
        loss = LOSS_AGG[a.loss_agg](loss_a * part, mask, n_step, a_step) * weight
        loss.backward()
        for k, v in s.items():
            stats.setdefault(k, []).append(v[part].float().mean().item() if part.any() else 0.0)
        stats.setdefault("approx_kl", []).append(
            (0.5 * (out.log_prob.detach() - mb.old_log_prob) ** 2)[part].mean().item() if part.any() else 0.0)
        stats.setdefault("loss", []).append(loss.item())
        for k, v in out.stats.items():  # per-action policy statistics, e.g. token entropy
            if v.shape == out.log_prob.shape and part.any():
                stats.setdefault(f"policy_{k}", []).append(v.detach()[part].float().mean().item())
        ratios.append(((s["ratio"] * part).sum(0), part.sum(0)))

    # -------------------------------------------------------------------------------------------- helpers
    def ema_weights(self):
        """The EMA weights in the policy while the context runs (evaluation, saving); nothing when EMA is off."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def evaluate(self, step: int) -> dict:
        """Held-out benchmark of the current (EMA when enabled) weights; logged as eval/*."""
        with self.ema_weights():
            # through the runner: a sample whose reward fails scores 0 (and is logged) instead of ending the run
            res = evaluate_outputs(self.policy.evaluate, self.task.eval_examples(), lambda o, e: self.eval_reward(o, e)[0],
                                   seed=10_000, progress=self.cfg.log.progress)
        flat = {f"eval/{k}": v for k, v in res.items() if k not in ("per_category", "n")}
        for c, d in res["per_category"].items():
            flat.update({f"eval_by_category/{c}/{k}": v for k, v in d.items() if k != "n"})
        self.logger.scalars(step, flat)
        log.info("eval at iteration %d: %s", step, json.dumps({k: v for k, v in res.items() if k != "per_category"}))
        return res

    # ------------------------------------------------------------------------------------- checkpoints
    def save(self) -> str:
        """Write checkpoints/iter-N (atomically; mmrl/checkpoint.py) and return its path."""
        return ckpt.save_trainer(self)

    def resume(self) -> bool:
        """Load the latest checkpoint in log.out_dir; False when there is none."""
        return ckpt.resume_trainer(self)


def train(cfg: Config, resume: bool = False) -> dict:
    trainer = Trainer(cfg)
    os.makedirs(cfg.log.out_dir, exist_ok=True)
    with open(os.path.join(cfg.log.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    if resume and not trainer.resume():
        log.warning("--resume: no checkpoint in %s/checkpoints; starting from scratch", cfg.log.out_dir)
    results = trainer.fit()
    trainer.dist.close()
    return results
