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
import json
import logging
import math
import os
import random
import time

import torch
from tqdm import tqdm

from mmrl import checkpoint as ckpt
from mmrl import compiled, compose
from mmrl.parallel import shards
from mmrl.algorithms import ADVANTAGES
from mmrl.algorithms.objective import Batch
from mmrl.algorithms.offpolicy import injection_diagnostics
from mmrl.config import Config, sample_chunk
from mmrl.data import Rollout, micro_batches, stratified_minibatches
from mmrl.devices import set_cpu_threads
from mmrl.parallel.distributed import Distributed, check_parallel_config
from mmrl.errors import ConfigError
from mmrl.evaluation import EVAL_BATCH, EVAL_SEED, evaluate_outputs
from mmrl.metrics import Logger, Pulse, SignalWatch, Timer, per_category, perf
from mmrl.micro_batch import resolve_micro_batch
from mmrl.rollout.collect import Collector
from mmrl.train_stats import PassStats
from mmrl.optim import EMA, adamw, lr_scale, soft_update_decay
from mmrl.preemption import StopRequests, stop_run
from mmrl.seeds import derive_seed
from mmrl.report import log_evaluation
from mmrl.reward import RewardRunner

log = logging.getLogger(__name__)
ITERATION_PULSE_S = 10.0  # without bars (a log file): a line naming the phase every this many s of an iteration
MAX_NONFINITE_STEPS = 3  # optimizer steps in a row with a non-finite gradient before the run stops


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = compose.checked(cfg)  # a config from load_config is not checked twice
        set_cpu_threads(cfg.train.threads)
        check_parallel_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any weight loads
        self.dist = Distributed(cfg.train.parallel, cfg.train.context_parallel, cfg.train.cp_kind,
                                cfg.train.dist_timeout_min, cfg.train.shard_size)
        ckpt.check_shared_run_dir(cfg.log.out_dir, self.dist)  # several nodes: one run folder they all see
        resolve_micro_batch(cfg, self.dist)  # train.micro_batch=auto: the largest that fits, decided on rank 0
        # the task before the weights: its input errors (an empty prompt file...) come in seconds, not after a load
        with self.dist.main_first():  # a task that writes its data (the grounding world) does it once
            self.task = compose.build_task(cfg.task)
        torch.manual_seed(cfg.train.seed)  # the same initial weights (and LoRA init) on every rank
        self.policy = compose.build_policy(cfg, self.dist)  # under FSDP: loaded into shards by parallelize
        algo = compose.build_algorithm(cfg)  # built once: objective (terms), reward shaping, credit assignment
        self.objective, self.shaping, self.credit = algo.objective, algo.shaping, algo.credit
        self.policy.reads = self.objective.reads  # a training pass builds only the statistics its objective reads
        if cfg.train.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        if self.dist.cp > 1:  # before DDP / FSDP wrap the transformers
            self.policy.context_parallel(self.dist.mesh, cfg.train.cp_kind)
        if self.dist.world > 1:
            self.policy.dist = self.dist  # policies that must keep ranks in lockstep (FSDP decoding) use it
            self.policy.parallelize(lambda m: self.dist.wrap(m, cfg.train.mixed_precision), cfg.train.parallel)
        compiled.compile_policy(self.policy, cfg.train)  # after LoRA and DDP / FSDP2 wrapping: they run in the blocks
        self.reward_fn = compose.build_reward(cfg.reward.name, cfg.reward.kwargs)
        self.reward = RewardRunner(self.reward_fn, cfg.reward.on_error, sample_chunk(cfg.train))
        self.eval_reward = self.reward if not cfg.reward.eval_name else RewardRunner(compose.build_reward(
            cfg.reward.eval_name, cfg.reward.eval_kwargs, "reward.eval"), cfg.reward.on_error, sample_chunk(cfg.train))
        self.params = list(self.policy.trainable_parameters())
        if not self.params:
            raise ConfigError("the policy has no trainable parameters (check model.lora settings)")
        self.opt = adamw(self.params, cfg.train.lr, cfg.train.weight_decay)  # fused where the parameters allow
        self.ema = EMA(self.params, cfg.train.ema_decay, self.dist.reshard) if cfg.train.ema_decay > 0 else None
        self.sampling = EMA(self.params, 0.0, self.dist.reshard) if cfg.train.sampling_ema else None  # old policy
        self.iteration, self.nonfinite = 0, 0  # nonfinite: optimizer steps in a row skipped for a non-finite gradient
        self.watch = SignalWatch(cfg.reward, cfg.task.name, cfg.train.zero_signal_patience)
        self.timed_evals: list[dict] = []
        self.eval_start: dict | None = None  # the base model's held-out figures (kept across a resume)
        self.saved_at, self.saved_path = -1, None  # the iteration of this process's last save, and its folder
        self.elapsed_min = 0.0  # training minutes so far (saved: a resumed run keeps its budget and lr schedule)
        # One optimizer step per epoch: every row's first forward runs under the sampling weights, so the rollout's
        # old log-probs are that forward's (detached) values; policies that must pay a forward for them skip it.
        self.policy.defer_old_log_prob = cfg.train.minibatches == cfg.train.grad_accum and self.sampling is None
        self.logger, self.timer = Logger(cfg.log.out_dir, cfg.log.tensorboard, enabled=self.dist.main,
                                         report_to=cfg.log.report_to, config=cfg), Timer()
        self.collect = Collector(cfg, self.policy, self.task, self.reward, self.dist, self.timer)

    # ------------------------------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train to train.iterations (or the time budget); returns the results also written to results.json.
        Every branch taken from a clock or a signal is decided once per iteration for all ranks
        (`Distributed.decide`): rank 0's minutes, and a stop when any rank was signalled (mmrl/preemption.py)."""
        cfg, t = self.cfg, self.cfg.train
        with StopRequests() as stop:
            if cfg.log.eval_at_start and self.iteration == 0:
                self.eval_start = self.evaluate(0)
            results = {} if self.eval_start is None else {"eval_start": self.eval_start}
            t_start = time.time() - 60 * self.elapsed_min  # a resumed run continues its time budget
            if spent := 0 < t.time_budget_min <= self.elapsed_min:  # a resumed run whose budget is spent: no training
                log.warning("train.time_budget_min=%s is spent (%.1f min trained): nothing to train; resume with a larger "
                            "train.time_budget_min to continue", t.time_budget_min, self.elapsed_min)
            bar = tqdm(range(self.iteration, self.iteration if spent else t.iterations), desc="train",
                       disable=not cfg.log.progress or not self.dist.main, initial=self.iteration, total=t.iterations)
            for it in bar:
                self.iteration = it
                lr = t.lr * lr_scale(it, t.iterations, self.elapsed_min, t.time_budget_min, t.lr_warmup, t.lr_cooldown)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                t_it = time.time()
                say = lambda: log.info("iteration %d/%d: %s, %.0f s so far", it + 1, t.iterations,  # noqa: E731
                                       self.timer.phase or "between phases", time.time() - t_it)
                with Pulse(say, ITERATION_PULSE_S, enabled=not cfg.log.progress and self.dist.main):  # a log file
                    step = self.step(it)
                metrics = {**step, "train/lr": lr, **perf(t, time.time() - t_it)}
                self.iteration = it + 1
                self.elapsed_min, stopping = self.dist.decide((time.time() - t_start) / 60, stop.signum is not None)
                bar.set_postfix(reward=f"{metrics['reward/overall_mean']:.3f}")
                self.logger.scalars(it + 1, metrics)  # step = iterations done, as the log line and eval/
                if not cfg.log.progress and self.dist.main:  # no bars (a log file): one line per iteration
                    log.info("iteration %d/%d: reward %.4f, loss %.4g, %.1f s (%.1f min in all)", it + 1, t.iterations,
                             metrics["reward/overall_mean"], metrics.get("train/loss", 0.0),
                             metrics["perf/iteration_s"], self.elapsed_min)
                if stopping:
                    stop_run(self, stop.signum)
                out_of_time = t.time_budget_min > 0 and self.elapsed_min >= t.time_budget_min
                last = self.iteration == t.iterations or out_of_time
                timed = cfg.log.eval_every_min and self.elapsed_min >= cfg.log.eval_every_min * (1 + len(self.timed_evals))
                if (cfg.log.eval_every and self.iteration % cfg.log.eval_every == 0 or timed) and not last:
                    res = self.evaluate(self.iteration)
                    if timed:
                        self.timed_evals.append({"minutes": self.elapsed_min, "iteration": self.iteration, **res})
                if cfg.log.save_every and self.iteration % cfg.log.save_every == 0 or last:
                    self.save()
                if out_of_time:
                    log.warning("train.time_budget_min=%s reached after %d iterations", t.time_budget_min,
                                self.iteration)
                    break
            if self.dist.decide(0.0, stop.signum is not None)[1]:  # signalled during the last iteration's evaluation
                stop_run(self, stop.signum)
        results["eval_end"] = self.evaluate(self.iteration)
        results["eval_timed"] = self.timed_evals  # log.eval_every_min: [{minutes, iteration, metrics...}]
        results["iterations"] = self.iteration
        if self.dist.main:  # one writer
            with open(os.path.join(cfg.log.out_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
        self.logger.close()
        self.collect.close()
        return results

    def step(self, it: int) -> dict:
        cfg, t, a = self.cfg, self.cfg.train, self.cfg.algo
        seed = derive_seed(t.seed, "iteration", it)  # per-iteration seeds: resuming needs no RNG state
        torch.manual_seed(seed)
        if t.threads == "auto":
            set_cpu_threads("auto")  # the cores other processes leave free now
        self.policy.iteration = it  # schedules that move with training (sampler.window_schedule=sliding)
        weights = self.reward.at_iteration(it)  # several rewards: their (scheduled) weights at this iteration
        with self.sampling_weights(it):
            rollout, rewards, valid, metrics = self.collect(random.Random(seed), torch.Generator().manual_seed(seed), it)
        metrics.update({f"reward/{k}_weight": w for k, w in (weights or {}).items()})
        shaping = self.shaping  # algo.shaping with its knobs
        extra, stats = self.collect.contrast(rollout, seed) if shaping.needs_contrast else ((), {})
        metrics.update(stats)  # e.g. T-GRPO: the same prompts with shuffled frames, scored, never trained
        local = rollout
        if self.dist.world > 1:  # advantages need whole groups: every rank sees every row's reward, in order
            rollout, rewards, valid, rows = self.dist.gather_rows(
                rollout, rewards, valid, getattr(self.credit, "reads_extras", ()))
        extra = ((rollout.group_id, *extra),) if extra else ()
        metrics["rollout/actions_mean"] = rollout.action_mask.sum(-1).float().mean().item()  # tokens: completion length
        shaped = shaping(rewards["overall"], *extra)
        adv, adv_stats = self.credit({**rewards, "overall": shaped}, weights, rollout,
                                     valid, cfg, it)  # [N] or [N, A] (tree rollouts: per transition)
        self.watch(valid, adv, self.reward.last_error)
        rollout.action_mask &= valid.unsqueeze(-1)
        metrics.update({f"reward/{k}_mean": v[valid].mean().item() if valid.any() else 0.0 for k, v in rewards.items()})
        metrics["reward/overall_std"] = rewards["overall"][valid].std().item() if valid.sum() > 1 else 0.0
        metrics.update(adv_stats)
        metrics.update(injection_diagnostics(shaped, rollout.group_id, valid, rollout.is_offpolicy,
                                             lambda r, g, v: ADVANTAGES[a.advantage](r, g, v, a)[0]))
        metrics.update(per_category(rollout.examples, rewards["overall"], valid))
        overall, row_actions, groups = rewards["overall"], rollout.action_mask.sum(-1), rollout.group_id  # [N]
        if self.dist.world > 1:  # back to this rank's rows (a padding row, group id -1, has none: zero advantage)
            rollout, adv, overall = self.dist.local_rows(local, rollout, rows, adv, overall)
        else:
            rows = torch.arange(len(rollout))
        with self.timer("train"):
            metrics.update(self.optimize(rollout, adv, rows, row_actions, groups))
        metrics.update(self.timer.pop())
        if cfg.log.image_every and it % cfg.log.image_every == 0:  # rank 0's rows
            self.logger.samples(it + 1, rollout.outputs, rollout.examples, overall, t.group_size)
        return metrics

    def optimize(self, rollout: Rollout, adv: torch.Tensor, rows: torch.Tensor | None = None,
                 row_actions: torch.Tensor | None = None, groups: torch.Tensor | None = None) -> dict:
        """rows [n]: the positions of this rank's rows in the single-process order; row_actions [N]: trained actions
        of every row (all ranks); groups [N]: every row's group id; one process: the rollout's rows, their action
        counts and group ids. Minibatches are stratified by group (`stratified_minibatches`: every minibatch takes
        G / minibatches rows of each group, so a rank holds the same share of every minibatch); each rank trains its
        rows of them (`train_minibatch`). Returns the passes' statistics."""
        t = self.cfg.train
        if rows is None:
            rows, row_actions, groups = torch.arange(len(rollout)), rollout.action_mask.sum(-1), rollout.group_id
        local = torch.full((len(row_actions),), -1, dtype=torch.long)
        local[rows] = torch.arange(len(rows))                    # single-process position -> this rank's row
        stats, steps = PassStats(), 0
        for epoch in range(t.inner_epochs):
            gen = torch.Generator().manual_seed(derive_seed(t.seed, "minibatches", epoch, self.iteration))
            chunks = stratified_minibatches(groups, t.minibatches, gen)  # [n_m] rows of each minibatch
            for m in tqdm(range(t.minibatches), desc=f"train epoch {epoch}", leave=False,
                          disable=not self.cfg.log.progress or t.minibatches == 1 or not self.dist.main):
                # Normalize by the sizes of the optimizer step's whole batch (grad_accum minibatches): the
                # gradient of one step is that of its full-batch loss whatever the minibatch split.
                first = m - m % t.grad_accum
                step_rows = torch.cat(chunks[first:first + t.grad_accum])
                sizes = (len(step_rows) / self.dist.world, max(int(row_actions[step_rows].sum()), 1) / self.dist.world)
                mine = local[chunks[m]]
                loss = self.train_minibatch(rollout, adv, mine[mine >= 0], sizes, (m + 1) % t.grad_accum == 0,
                                            steps, stats)
                stats.put("loss", loss, int(self.dist.main))
                if (m + 1) % t.grad_accum == 0:
                    steps += self.step_optimizer(stats)
        out = stats.summary(self.dist, rollout.extras.get("step_index"))  # every rank's passes
        out["train/optimizer_steps"] = steps
        stats.warn(out, t.ratio_warn, self.iteration)
        if steps:  # an engine with its own weight copy (vLLM) reloads
            self.policy.sync_weights()
        return out

    def step_optimizer(self, stats: PassStats) -> int:
        """Clip and step (and update the EMA); 1, or 0 when the gradient is not finite: the step is skipped, so a NaN
        never reaches the weights (the norm is global, so every rank skips alike). Several in a row stop the run."""
        norm = shards.full(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)).item()
        stats.put("grad_norm", norm if math.isfinite(norm) else 0.0, 1)
        stats.put("skipped_steps", float(not math.isfinite(norm)), 1)
        if math.isfinite(norm):
            self.opt.step()
            if self.ema is not None:
                self.ema.update()
        self.opt.zero_grad(set_to_none=True)
        self.nonfinite = 0 if math.isfinite(norm) else self.nonfinite + 1
        if self.nonfinite:
            log.warning("iteration %d: the gradient norm is %s: optimizer step skipped", self.iteration, norm)
        if self.nonfinite >= MAX_NONFINITE_STEPS:
            raise RuntimeError(f"{self.nonfinite} optimizer steps in a row had a non-finite gradient (skipped): the loss "
                               f"is out of range. Lower train.lr, train in fp32 (model.dtype=float32, train.mixed_precision=no) "
                               f"or check the reward for inf values")
        return int(math.isfinite(norm))

    def train_minibatch(self, rollout, adv, mine, sizes, syncs: bool, steps: int, stats: PassStats) -> torch.Tensor:
        """Forward / backward of this rank's rows `mine` of a minibatch in micro-batches, normalized by the optimizer
        step's sizes (rows, actions) / world (DDP / FSDP average the gradients over ranks). Every rank runs as many
        passes as the rank that needs the most (zero-weight padding passes of one micro-batch: a padding pass costs
        what a real one does), and gradients synchronize only in the step's last backward. Returns the minibatch's
        loss (the ranks' parts add up to it)."""
        t = self.cfg.train
        parts = list(micro_batches(rollout.action_mask, mine, t.micro_batch, self.policy.scores_actions)) \
            if len(mine) else []
        pad = next(micro_batches(rollout.action_mask, torch.tensor([0]), t.micro_batch, self.policy.scores_actions))
        loss, passes = 0.0, self.dist.max_int(len(parts))  # every rank joins the same collectives
        for j in range(passes):
            real = j < len(parts)
            idx, actions = parts[j] if real else pad
            with self.dist.no_sync(not (syncs and j == passes - 1)):
                part_loss, part_stats = self.accumulate(rollout, idx, actions, adv, sizes, 1.0 if real else 0.0,
                                                        first=not steps)
            if real:  # a padding pass has no statistics
                loss += part_loss
                stats.add_pass(*part_stats)
            del part_stats  # the pass's outputs go before the next forward (they would raise its peak)
        return loss / self.dist.world

    def accumulate(self, rollout, idx, actions, adv, sizes, weight: float, first: bool) -> tuple[torch.Tensor, tuple]:
        """Forward and backward of rows `idx` (only `actions` [n, A] when given) with the loss normalized by the
        optimizer step's `sizes` (rows, actions) and times `weight` (0: a padding pass): the gradients of the parts
        add up to the gradient of the whole minibatch. `first`: no optimizer step yet this iteration. Returns (the
        part's loss, its statistics as PassStats.add_pass's arguments)."""
        kw, obj = ({} if actions is None else {"actions": actions}), self.objective
        ema_ref = self.cfg.algo.kl_reference == "ema"  # before the forward with gradients (EMA: swapped in place)
        ref = self.frozen_forward(self.ema.swapped() if ema_ref else self.policy.reference(), rollout, idx, kw) \
            if obj.needs_reference else None
        shared = ema_ref and ref is not None  # an EMA anchor reuses the KL's forward when its reference is the EMA too
        anchor = (ref if shared else self.frozen_forward(self.ema.swapped(), rollout, idx, kw)) if obj.needs_ema_anchor else None
        with self.dist.autocast(self.cfg.train.mixed_precision, self.policy):
            out = self.policy.log_prob(rollout, idx, **kw)
        deferred = torch.isnan(rollout.old_log_prob[idx])
        if deferred.any():  # fill deferred old log-probs from this first forward (weights unchanged)
            if not first:
                raise RuntimeError("the rollout's old log-probs are NaN after an optimizer step: the sampling forward "
                                   "was not finite (deferred old log-probs are only filled before the first step)")
            old = rollout.old_log_prob[idx]
            rollout.old_log_prob[idx] = torch.where(deferred, out.log_prob.detach().to(old), old)
        dev = out.log_prob.device  # the loss runs where the log-probs are; bookkeeping comes from CPU
        mb = rollout.view(idx, dev)  # its extras gathered as the loss reads them
        mask = mb.action_mask  # the whole rows' actions normalize the loss; this part's actions carry it
        part = mask if actions is None else mask & actions.to(dev)
        loss_a, s = obj.per_action(Batch(None, mb.old_log_prob, adv[idx].to(dev), mb.group_id, part, mb, out, ref,
                                         anchor))
        loss = obj.aggregate(loss_a * part, mask, *sizes) * weight
        loss.backward()
        return loss.detach(), (out, mb, s, part, first)  # read once per iteration (PassStats)

    # -------------------------------------------------------------------------------------------- helpers
    def frozen_forward(self, weights, rollout, idx, kw):  # log-probs without gradients under `weights` (EMA, reference)
        with torch.no_grad(), weights, self.dist.autocast(self.cfg.train.mixed_precision, self.policy):
            return self.policy.log_prob(rollout, idx, **kw)

    def ema_weights(self):  # the EMA weights in the policy while the context runs (evaluation, saving), if any
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def sampling_weights(self, it: int):
        """The weights rollouts sample with: the old policy soft-updated first (train.sampling_ema), else the current."""
        if self.sampling is not None:
            self.sampling.update(soft_update_decay(it, *self.cfg.train.sampling_ema))
        return self.sampling.swapped() if self.sampling is not None else contextlib.nullcontext()

    def evaluate(self, step: int) -> dict:
        """Held-out benchmark of the current (EMA when enabled) weights; logged as eval/*."""
        # a sample whose reward fails scores 0 (logged); at the start a failing reward stops at its first failure
        on_error = self.eval_reward.on_error
        self.eval_reward.on_error = "raise" if step == 0 else on_error
        self.eval_reward.at_iteration(step)  # scheduled weights as at this step (also after a resume)
        try:
            with self.ema_weights():
                res = evaluate_outputs(self.policy.evaluate, self.task.eval_examples(),
                                       lambda o, e: self.eval_reward(o, e)[0], seed=EVAL_SEED,
                                       batch_size=sample_chunk(self.cfg.train) or EVAL_BATCH, draws=self.cfg.log.eval_draws,
                                       progress=self.cfg.log.progress if self.dist.main else None, dist=self.dist)
        finally:
            self.eval_reward.on_error = on_error
        log_evaluation(self.logger, step, res, self.dist.main)  # eval/* scalars, one line for people
        return res

    # ------------------------------------------------------------------------------------- checkpoints
    def save(self) -> str:  # checkpoints/iter-N, written atomically (mmrl/checkpoint.py); returns its path
        self.saved_path = ckpt.save_trainer(self)
        self.saved_at = self.iteration
        return self.saved_path

    def resume(self) -> bool:  # the newest intact checkpoint in log.out_dir loaded; False when there is none
        return ckpt.resume_trainer(self)

    def reopen_logger(self, resume: tuple[int | None, int]) -> None:  # logs cut back to a checkpoint (Logger's resume)
        self.logger.close()
        self.logger = Logger(self.cfg.log.out_dir, self.cfg.log.tensorboard, enabled=self.dist.main, resume=resume,
                             report_to=self.cfg.log.report_to, config=self.cfg)

