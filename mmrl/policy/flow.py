"""Flow-matching generator policy (diffusers SD3 / FLUX / Wan / Qwen-Image / Z-Image transformers, or the embedded
pixel models; pixel or VAE-latent space).

Actions are denoising steps. `sample` runs G chains per prompt with the configured SDE sampler on a window of
steps (ODE elsewhere, optionally DPM-Solver++(2M) over strided sigmas), or one BranchGRPO tree per prompt
(tree.split_steps; mmrl/rollout/tree.py), and stores, for each SDE step, x_t, x_{t+1}, sigma_t, sigma_{t+1}, the
rollout-time mean and std; `log_prob` recomputes the Gaussian log-density of the stored x_{t+1} under the current
weights with the same CFG scale, the same std and the same reduction, batching all n * A steps in one forward.
The last (lowest-sigma) step is never trained (its likelihood overflows; docs/algorithms.md §1).
With a forward-process loss (algo.objective.name=awm | nft; docs/algorithms.md §10) the actions are instead K noise
levels of each final sample, and the "log-prob" is the negative flow-matching loss there.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os

import torch

from mmrl.cache import BoundedCache
from mmrl.config import SHARDED
from mmrl.data import PolicyOutput, Rollout, condition_images, group_ids, in_chunks, load_image, whole_groups
from mmrl.errors import ConfigError
from mmrl.policy.base import (PolicyDefaults, load_lora_adapter, save_lora_adapter, upcast_trainable,
                              write_policy_meta)
from mmrl.models.decode_batch import decode_rows
from mmrl.models.families import lora_targets
from mmrl.models.flow_model import EXPERTS, FlowModel, expert_lockstep
from mmrl.models.shard_load import copy_shards, init_adapters, load_into_shards
from mmrl.policy.flow_checkpoint import (  # noqa: F401  (load_policy_checkpoint: the checkpoint loader's home is there)
    _link_base_parts, _load_transformer_weights, load_policy_checkpoint, save_diffusers_lora)
from mmrl.rollout.step_branch import run_branches
from mmrl.rollout.tree import run_tree, trained_steps
from mmrl.sampling.flow_sde import gaussian_log_prob, run_chain, step_mean_std, strided_schedule, window_in
from mmrl.seeds import derive_seed, row_seed

WEIGHTS_FILE = "trainable.safetensors"
log = logging.getLogger(__name__)


class FlowPolicy(PolicyDefaults):
    def __init__(self, *, model: FlowModel, sampler_cfg, lora_cfg, reference: str = "auto", model_path: str = "",
                 progress: bool = False, tree_cfg=None, model_options: dict | None = None, micro_batch: int = 0,
                 text_cache: int = 1024, offload: bool = False, objective: str = "transitions",
                 device: torch.device | None = None, seed: int = 0):
        """Keyword-only (mmrl/policy/flow_build.py fills them from a config). model: its family names the LoRA
        targets and pipeline; sampler_cfg, lora_cfg, tree_cfg: the config's sections; reference: reference_kind's
        "auto" | "none"; model_path, model_options: the base and how it loaded (kept in checkpoints); micro_batch:
        rows per no-grad forward (0 = all); offload: frozen parts wait on the CPU; objective: "transitions" (SDE
        steps are the actions) | "forward" (noise levels of x0, docs/algorithms.md §10); device: where the trained
        transformers go, needed when built on the meta device (loaded into shards by `parallelize`); seed: the run's
        (train.seed), from which LoRA's adapters start (`init_adapters`, the same whole or in shards)."""
        from mmrl.config import TreeConfig

        self.model, self.cfg, self.model_path, self.progress = model, sampler_cfg, model_path, progress
        self.model.cfg_grad = sampler_cfg.cfg_grad
        self.tree = tree_cfg or TreeConfig()
        self.model_options = model_options or {}  # how the base was loaded (sample_size ...), kept in checkpoints
        first = next(model.transformer.parameters())
        # the experts built on the meta device: their weights are read into shards once FSDP has split them
        # (only when `device` is given: the fake accelerator of the tests also reports the meta device type)
        self._pending = [n for n, tr in self.experts() if next(tr.parameters()).is_meta] if device is not None else []
        self.device = torch.device(device) if self._pending else first.device
        self.lora, self.seed = bool(lora_cfg.enabled), seed
        if self.lora:
            from peft import LoraConfig

            self.lora_config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, init_lora_weights="gaussian",
                                          target_modules=lora_targets(model.family, lora_cfg.target_modules))
        # {expert name: frozen copy} for a KL reference under full fine-tuning; LoRA disables its adapters instead
        self._ref_copy = {} if reference == "auto" and not self.lora else None
        for name, tr in self.experts():  # Wan2.2: each expert trains on the steps of its noise range
            tr.requires_grad_(not self.lora)
            if self.lora:
                tr.add_adapter(self.lora_config)
            if self._ref_copy is not None:  # before the upcast: the reference keeps model.dtype (the checkpoint's)
                self._ref_copy[name] = copy.deepcopy(tr).requires_grad_(False).eval()
            upcast_trainable(tr)  # on the meta device when loaded into shards: the shards are then made fp32
            if self.lora and name not in self._pending:  # else parallelize starts them in their shards
                self._start_adapters(name, tr)
            tr.train()
        self.has_reference = reference == "auto"
        self.sigmas = model.schedule(sampler_cfg.num_steps, sampler_cfg.shift)  # [S + 1], the family's shift
        # mean SDE std over the trainable steps 0 .. S-2 of the schedule (TempFlow-GRPO's weight normalizer)
        sig = self.sigmas[:-2]
        zeros = torch.zeros(len(sig), 1)
        _, stds = step_mean_std(sampler_cfg.kind, zeros, zeros, sig, self.sigmas[1:-1], sampler_cfg.noise_level,
                                float(self.sigmas[1]))
        self.schedule_std_mean = float(stds.mean())
        if objective == "forward" and sampler_cfg.branch_children:
            raise ConfigError("sampler.branch_children branches SDE steps, the actions of transition objectives; a "
                              "forward-process objective (awm, nft, dpo ...) trains noise levels: set branch_children=0")
        if objective == "transitions" and len(self.expert_steps()) < len(self.experts()):
            raise ConfigError(f"sampler.num_steps={sampler_cfg.num_steps} at shift {sampler_cfg.shift:g} puts no trainable "
                              f"step below sigma {model.boundary:g}, so transformer_2 would never train: use more steps "
                              f"or a lower shift (Wan2.2 T2V: 20 steps at shift 12 give each expert steps)")
        self._neg = None
        self._sampled_rows = 0  # rollout_counts: transformer rows of sampling since it was last read
        self.micro_batch = micro_batch  # rows per forward without gradients (sampling, decoding); 0 = all
        self.text_cache = BoundedCache(text_cache, 2**30)  # (prompt, images) -> (enc [L, D], pooled [P])
        self.condition_images = getattr(model.family, "condition_images", 0)  # images per example (edits, I2V)
        self.offload = offload  # frozen parts (text encoders, VAE, reference copy) wait on CPU between uses
        self.objective = objective  # transitions: the SDE steps are the actions | forward: noise levels of x0 (§10)
        if offload:
            for m in (*model.text_modules, *(self._ref_copy or {}).values()):
                m.to("cpu")

    # ----------------------------------------------------------------------------------------------- sampling
    def _window(self, generator: torch.Generator) -> list[int]:
        """Indices of the SDE (trained) steps: a window of sde_window_size steps, never the last step. Two experts
        (Wan2.2): one such window within each expert's steps (sde_window_range counted from its first step), so both
        train every iteration whatever the shift puts on either side of the boundary."""
        c = self.cfg
        return [i for steps in self.expert_steps() for i in window_in(
            steps, c.sde_window_size, c.sde_window_range, generator, c.window_schedule == "sliding" and
            self.iteration // c.window_shift_every)]

    def expert_steps(self) -> list[list[int]]:
        """The trainable steps (0 .. num_steps-2) each expert runs, highest noise first: one list for one transformer;
        Wan2.2's transformer at sigma >= boundary, transformer_2 below (an empty side is dropped)."""
        steps = list(range(self.cfg.num_steps - 1))
        if self.model.boundary is None or self.model.transformer_2 is None:
            return [steps]
        high = [i for i in steps if float(self.sigmas[i]) >= self.model.boundary]
        return [side for side in (high, [i for i in steps if i not in high]) if side]

    @property
    def autoencoders(self) -> list[torch.nn.Module]:
        """The frozen parts that decode (and encode) images: the VAE among the model's frozen modules."""
        return [m for m in self.model.text_modules if hasattr(m, "decode")]

    @contextlib.contextmanager
    def _onload(self, modules):
        """With model.offload: `modules` on the policy's device for the block, back on CPU after it."""
        if not self.offload:
            yield
            return
        for m in modules:
            m.to(self.device)
        try:
            yield
        finally:
            for m in modules:
                m.to("cpu")

    def images(self, examples: list[dict]) -> list[list] | None:
        """Each example's conditioning images (PIL) when the family conditions on images, else None."""
        if not self.condition_images:
            return None
        return [condition_images(ex, self.condition_images) for ex in examples]

    @torch.no_grad()
    def encode(self, texts: list[str], images: list[list] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(enc [n, L, D], pooled [n, P]) of texts (with each row's conditioning images): each distinct row runs
        the encoders once (a group shares its prompt's embedding) and stays cached across iterations (the
        encoders are frozen)."""
        keys = [(t, tuple(getattr(im, "filename", "") or id(im) for im in imgs) if images else ())
                for t, imgs in zip(texts, images or [None] * len(texts))]
        first: dict = {}  # each distinct key's first row
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        new = [k for k in first if k not in self.text_cache]
        if new:
            with self._onload(self.model.text_modules):
                enc, pooled = self.model.encode([k[0] for k in new], [images[first[k]] for k in new] if images else None)
            for i, k in enumerate(new):
                self.text_cache.get(k, lambda: (enc[i], pooled[i]))
        rows = [self.text_cache.get(k, None) for k in keys]
        if any(r is None for r in rows):  # the batch's own rows overflowed the cache: encode them directly
            with self._onload(self.model.text_modules):
                return self.model.encode(texts, images)
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def _negative(self, n: int, images: list[list] | None = None):
        """(enc [n, L, D], pooled [n, P]) of the empty prompt, with each row's conditioning images if any."""
        if images is not None:
            return self.encode([""] * n, images)
        if self._neg is None:
            with torch.no_grad():
                with self._onload(self.model.text_modules):
                    self._neg = self.model.negative(1)
        return self._neg[0].expand(n, -1, -1), self._neg[1].expand(n, -1)

    def _velocity_fn(self, enc, pooled, chunked: bool = True, images: list[list] | None = None):
        """v(x [n, *D], sigma [n]) with the prompts' embeddings enc [n, L, D], pooled [n, P] and CFG (the empty
        prompt's embeddings, with the rows' conditioning `images` if any); without gradients it runs micro_batch rows
        per forward (CFG doubles them) when `chunked`. Training passes (log_prob, the KL reference's included) are
        not chunked: the trainer's micro-batches bound them, and under FSDP every rank must run the same forwards
        whatever its pass holds."""
        cfg = self.cfg.cfg_scale
        if cfg == 1.0:
            fn = lambda x, s: in_chunks(lambda *a: self.model.velocity(*a), self.micro_batch if chunked else 0,  # noqa: E731
                                        x, s, enc, pooled)
        else:
            neg_enc, neg_pooled = self._negative(len(enc), images)

            def one(x, s, e, p, ne, np_):
                return self.model.velocity(x, s, e, p, cfg, (ne, np_))

            fn = lambda x, s: in_chunks(one, self.micro_batch if chunked else 0,  # noqa: E731
                                        x, s, enc, pooled, neg_enc, neg_pooled)
        if not chunked:
            return fn

        def counted(x, s):  # the sampling forwards' rows (CFG's two branches counted), for rollout_counts
            self._sampled_rows += len(x) * (1 if cfg == 1.0 else 2)
            return fn(x, s)

        return counted

    def rollout_counts(self) -> dict[str, list[int]]:
        """{"transformer_rows": [rows this process ran through the transformer without gradients since the last
        call: sampling, the forward-process actions' velocities; CFG's branches counted]}, logged per iteration."""
        rows, self._sampled_rows = self._sampled_rows, 0
        return {"transformer_rows": [rows]}

    @torch.no_grad()
    def sample(self, examples: list[dict], group_size: int, generator: torch.Generator,
               rows: torch.Tensor | None = None) -> Rollout:
        """Chain rollouts (G independent chains per prompt), or BranchGRPO trees when tree.split_steps is set.

        rows: only these of the B * G rows (several processes share one iteration's rows; a group may be cut).
        Each row's noise comes from its own seed, so a row is the same whichever process samples it."""
        texts = [ex["prompt"] for ex in examples]
        rows = torch.arange(len(texts) * group_size) if rows is None else rows
        if "outputs" in examples[0]:  # offline data: the outputs are given (preference pairs)
            return self._given(examples, group_size, generator, rows)
        if self.cfg.branch_children:  # TempFlow per-step branching: rows are whole prompts' children
            final, extras, old_log_prob = self._sample_branches(texts, group_size, generator,
                                                                whole_groups(rows, group_size), self.images(examples))
        else:
            final, extras, old_log_prob = self._sample_steps(texts, group_size, generator, rows, examples)
        with self._onload(self.autoencoders):  # model.offload: the VAE visits the device to decode
            images = decode_rows(self.model.decode, final, self.micro_batch)  # VAE: memory-bounded
        return Rollout(group_id=group_ids(len(texts), group_size)[rows], old_log_prob=old_log_prob,
                       action_mask=torch.ones(old_log_prob.shape, dtype=torch.bool),
                       examples=[examples[i // group_size] for i in rows.tolist()], outputs=images, extras=extras)

    def _sample_steps(self, texts, group_size, generator, rows, examples):
        """(final latents [n, *D], extras, old log-probs [n, A]) of chains or trees: the trained steps of a window
        shared by every row, or the noise levels of the final samples (forward-process objectives)."""
        row_images = self.images([examples[i // group_size] for i in rows.tolist()])
        if self.tree.split_steps:  # rows are whole trees (several processes shard by groups)
            traj, steps, extra = self._sample_tree(texts, generator, whole_groups(rows, group_size),
                                                   self.images(examples))
        else:
            traj, steps, extra = self._sample_chain(texts, group_size, generator, rows.tolist(), self.images(examples))
        n, w = len(rows), torch.tensor(steps)
        p = torch.tensor(extra.pop("pos", steps))                   # where the trained steps sit in the trajectory
        seeds = extra.pop("seeds", None)
        enc, pooled = extra.pop("enc"), extra.pop("pooled")
        if self.objective == "forward":
            extras, old_log_prob = self._forward_actions(traj.latents[:, -1], enc, pooled, seeds, row_images)
        else:
            a = len(steps)
            extras = {
                "latents": traj.latents[:, p],                           # [N, A, C, H, W] x_t
                "next_latents": traj.latents[:, p + 1],                  # [N, A, C, H, W] x_{t+1}
                "old_mean": traj.mean[:, p],                             # [N, A, C, H, W]
                "std": traj.std[:, p],                                   # [N, A]
                "sigma": self.sigmas[w].expand(n, a).clone(),            # [N, A]
                "sigma_next": self.sigmas[w + 1].expand(n, a).clone(),   # [N, A]
                "step_index": w.expand(n, a).clone(),                    # [N, A]
                **{k: v[:, w] if v.dim() == 2 else v for k, v in extra.items()},
            }
            old_log_prob = traj.log_prob[:, p]
        extras.update(enc=enc, pooled=pooled)                            # [N, L, D], [N, P]
        return traj.latents[:, -1], extras, old_log_prob

    def _given(self, examples: list[dict], group_size: int, generator: torch.Generator, rows: torch.Tensor) -> Rollout:
        """A rollout of outputs the data gives instead of samples: each example's `outputs` (G image paths, e.g. a
        preference pair's chosen and rejected images) resized to the model's output size and encoded to final
        latents x0 (model.encode_latents), then the forward-process actions of §10 on them; each row's example gets
        its `labels[j]` as "label" (the preference reward reads it). Forward-process objectives only (dpo, nft ...)."""
        if self.objective != "forward" or self.model.encode_latents is None:
            raise ConfigError("examples with given `outputs` (offline preference pairs) train forward-process objectives "
                              "(algo.objective.name=dpo, nft, awm, dgpo) of an image model whose family encodes images")
        seeds, g = self._seeds(len(examples) * group_size, generator), group_size
        for ex in examples:
            if len(ex["outputs"]) != g or len(ex.get("labels", [0] * g)) != g:
                raise ConfigError(f"example {ex['prompt'][:60]!r} gives {len(ex['outputs'])} outputs (and labels); "
                                  f"train.group_size={g} must equal that count")
        picked = rows.tolist()
        side = self.model.latent_shape[-1] * self.model.image_scale
        images = torch.stack([load_image(examples[i // g]["outputs"][i % g], side) for i in picked])  # [n, 3, s, s]
        row_examples = [{**examples[i // g], "label": float(examples[i // g].get("labels", [0.0] * g)[i % g])}
                        for i in picked]
        with self._onload(self.autoencoders):
            x0 = self.model.encode_latents(images.to(self.device))                   # [n, *latent_shape]
        cond = self.images(row_examples)
        enc, pooled = self.encode([ex["prompt"] for ex in row_examples], cond)
        extras, old_log_prob = self._forward_actions(x0, enc, pooled, [seeds[i] for i in picked], cond)
        extras.update(enc=enc, pooled=pooled)
        return Rollout(group_id=group_ids(len(examples), g)[rows], old_log_prob=old_log_prob,
                       action_mask=torch.ones(old_log_prob.shape, dtype=torch.bool), examples=row_examples,
                       outputs=images, extras=extras)

    def _forward_actions(self, x0: torch.Tensor, enc: torch.Tensor, pooled: torch.Tensor, seeds: list[int],
                         images: list[list] | None = None):
        """The actions of forward-process losses (algo.objective.name=awm | nft; docs/algorithms.md §10): per final
        sample x0 [n, *D], K = sampler.forward_timesteps noise levels t ~ U(forward_t_range) and noises eps drawn
        from the row's seed, x_t = (1 - t) x0 + t eps, and the sampling weights' velocity there (no gradient).
        Old log-prob of an action: -mean_d (v_old - (eps - x0))^2, the negative flow-matching loss."""
        k, (lo, hi) = self.cfg.forward_timesteps, self.cfg.forward_t_range
        gens = [torch.Generator().manual_seed(row_seed(s, "forward_noise")) for s in seeds]
        t = torch.stack([lo + (hi - lo) * torch.rand(k, generator=g) for g in gens]).to(x0.device)     # [n, K]
        eps = torch.stack([torch.randn(k, *x0.shape[1:], generator=g) for g in gens]).to(x0)           # [n, K, *D]
        tb = t.reshape(*t.shape, *([1] * (x0.dim() - 1)))
        xt = (1 - tb) * x0[:, None] + tb * eps                                                          # [n, K, *D]
        images = None if images is None else [im for im in images for _ in range(k)]
        v = self._velocity_fn(enc.repeat_interleave(k, 0), pooled.repeat_interleave(k, 0), images=images)(
            xt.flatten(0, 1), t.flatten())
        v, target = v.float().view_as(xt), (eps - x0[:, None]).float()
        extras = {"latents": xt, "target": target, "old_velocity": v, "sigma": t,
                  "step_index": torch.arange(k).expand(len(x0), k).clone()}
        return extras, -(v - target).pow(2).flatten(2).mean(-1).cpu()

    def _seeds(self, n: int, generator: torch.Generator) -> list[int]:
        return torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()

    def _sample_chain(self, texts, group_size, generator, rows: list[int], images: list[list] | None = None):
        seeds = self._seeds(len(texts) * group_size, generator)     # one per row of the whole batch
        init = [seeds[i - i % group_size] for i in range(len(seeds))] if self.cfg.shared_noise else seeds
        # shared_noise: one initial noise per group (rows b*G .. b*G+G-1 start from seed b*G)
        window = self._window(generator)
        images = None if images is None else [images[i // group_size] for i in rows]
        enc, pooled = self.encode([texts[i // group_size] for i in rows], images)        # [n, L, D], [n, P]
        x = self.model.initial_noise([init[i] for i in rows], self.device)              # [n, C, H, W]
        step_noise = [torch.Generator(self.device).manual_seed(row_seed(seeds[i], "step_noise")) for i in rows]
        kinds = ["ode"] * self.cfg.num_steps
        for i in window:
            kinds[i] = self.cfg.kind
        sigmas, kinds, pos = strided_schedule(self.sigmas, kinds, self.cfg.ode_stride)  # MixGRPO-Flash when > 1
        traj = run_chain(self._velocity_fn(enc, pooled, images=images), x, sigmas, kinds, self.cfg.noise_level,
                         generator=step_noise, reduce=self.cfg.logprob_reduce, progress=self.progress,
                         ode_solver=self.cfg.ode_solver)
        return traj, window, {"enc": enc, "pooled": pooled, "pos": [pos[i] for i in window],
                              "seeds": [seeds[i] for i in rows]}

    def _sample_branches(self, texts, group_size, generator, groups: list[int], images: list[list] | None = None):
        """TempFlow-GRPO per-step branching (mmrl/rollout/step_branch.py) of prompts `groups` of the batch's
        len(texts): one trunk per prompt from the prompt's seed, sampler.branch_children SDE children at each step
        of the window, each child's noise from its own seed. Returns (final [n, *D], extras, old log-probs [n, 1])."""
        k = self.cfg.branch_children
        seeds = self._seeds(len(texts), generator)                     # one per prompt of the whole batch
        steps = sorted(self._window(generator))
        if len(steps) * k != group_size:
            raise ConfigError(f"sampler.branch_children={k} at {len(steps)} branch steps give {len(steps) * k} rows per "
                              f"prompt: set train.group_size={len(steps) * k} (got {group_size})")
        texts, seeds = [texts[i] for i in groups], [seeds[i] for i in groups]
        images = None if images is None else [images[i] for i in groups]
        enc, pooled = self.encode(texts, images)                       # [B, L, D], [B, P]
        gens = [torch.Generator(self.device).manual_seed(derive_seed(s, "branch_noise", r))
                for s in seeds for r in range(group_size)]             # one per child row

        def velocity(x, s, prompt):  # x [M, C, H, W], s [M], prompt [M]: the prompt of each row
            return self._velocity_fn(enc[prompt], pooled[prompt],
                                     images=None if images is None else [images[i] for i in prompt.tolist()])(x, s)

        br = run_branches(velocity, self.model.initial_noise(seeds, self.device), self.sigmas, steps, k,
                          self.cfg.kind, self.cfg.noise_level, gens, self.cfg.logprob_reduce, self.progress)
        j = br.step.unsqueeze(1)                                       # [n, 1] each child's one action
        extras = {"latents": br.latents[:, None], "next_latents": br.next_latents[:, None],   # [n, 1, C, H, W]
                  "old_mean": br.mean[:, None], "std": br.std[:, None],                       # [n, 1, C, H, W], [n, 1]
                  "sigma": self.sigmas[j], "sigma_next": self.sigmas[j + 1], "step_index": j,  # [n, 1]
                  "enc": enc.repeat_interleave(group_size, 0), "pooled": pooled.repeat_interleave(group_size, 0)}
        return br.final, extras, br.log_prob[:, None]

    def _sample_tree(self, texts, generator, trees: list[int], images: list[list] | None = None):
        """Trees `trees` of the batch's len(texts): each tree's noise comes from its own seed (one generator per
        tree, its paths drawing in order), so a tree is the same whichever process grows it."""
        t = self.tree
        seeds = self._seeds(len(texts), generator)
        texts, seeds = [texts[i] for i in trees], [seeds[i] for i in trees]
        images = None if images is None else [images[i] for i in trees]
        enc, pooled = self.encode(texts, images)                    # [B, L, D], [B, P]
        x = self.model.initial_noise(seeds, self.device)             # [B, C, H, W] one root noise per tree
        last = self.cfg.num_steps - 1
        sde = self._window(generator) if self.cfg.sde_window_size else range(last)  # Mix: window + splits
        kinds = ["ode"] * self.cfg.num_steps
        for i in set(sde) | set(t.split_steps):
            kinds[i] = self.cfg.kind

        def velocity(x, s, tree):  # x [M, C, H, W], s [M], tree [M]: the prompt of each alive path
            return self._velocity_fn(enc[tree], pooled[tree],
                                     images=None if images is None else [images[i] for i in tree.tolist()])(x, s)

        tr = run_tree(velocity, x, self.sigmas, kinds, t.split_steps, t.branch, self.cfg.noise_level,
                      generator=[torch.Generator(self.device).manual_seed(s) for s in seeds], reduce=self.cfg.logprob_reduce,
                      split_noise_scale=t.split_noise_scale, progress=self.progress)
        g = t.branch ** len(t.split_steps)
        n = len(texts) * g
        return tr, trained_steps(kinds, t.split_steps), {
            "enc": enc.repeat_interleave(g, 0), "pooled": pooled.repeat_interleave(g, 0),
            "tree_node": tr.node,                                    # [N, S] -> [N, A]
            "tree_depth": tr.depth.expand(n, -1).clone()}            # [N, S] -> [N, A]

    # ------------------------------------------------------------------------------------------------ scoring
    scores_actions = True  # log_prob of a subset of a sample's actions is exact (the trainer micro-batches them)

    def log_prob(self, rollout: Rollout, index: torch.Tensor, actions: torch.Tensor | None = None) -> PolicyOutput:
        """Only the actions in rollout.action_mask (and in `actions` [n, A] when given) run the transformer, all
        in one forward; the others (pruned tree transitions, invalid samples, other micro-batches) keep their old
        values, ratio 1, and no gradient. Only the stored tensors of those actions are gathered, and only the
        statistics in `reads` (the objective's, set by the trainer; None: all) are built."""
        mask = rollout.action_mask[index].clone()
        if actions is not None:
            mask &= actions
        if not mask.any():
            mask[0, 0] = True  # keep a graph so backward works; the trainer's mask zeroes this action's loss
        rows, cols = mask.nonzero(as_tuple=True)                      # k trained actions
        at, stored, dev = index[rows], rollout.extras, self.device    # at [k]: each action's rollout row
        pick = lambda k: stored[k][at, cols].to(dev)                  # stored [N, A, ...] -> [k, ...]
        whole = lambda k: stored[k][index].to(dev)                    # stored [N, A, ...] -> [n, A, ...]
        place = lambda base, val: base.index_put((rows, cols), val)   # [k, ...] into [n, A, ...], differentiable
        want = lambda k: self.reads is None or k in self.reads
        old = rollout.old_log_prob[index].to(dev)
        images = self.images([rollout.examples[i] for i in index.tolist()])
        images = None if images is None else [images[i] for i in rows.tolist()]
        v = self._velocity_fn(stored["enc"][at].to(dev), stored["pooled"][at].to(dev), chunked=False,
                              images=images)(pick("latents"), pick("sigma")).float()          # [k, *D]
        if self.objective == "forward":  # the negative flow-matching loss of each noise level (§10)
            lp = -(v - pick("target")).pow(2).flatten(1).mean(1)
            stats = {k: whole(k) for k in ("sigma", "old_velocity", "target") if want(k)}
            if want("velocity"):
                stats["velocity"] = place(whole("old_velocity"), v)
            return PolicyOutput(place(old, lp), stats)
        sigma, sigma_next, std = pick("sigma"), pick("sigma_next"), pick("std")
        mean, _ = step_mean_std(self.cfg.kind, pick("latents"), v, sigma, sigma_next, self.cfg.noise_level,
                                float(self.sigmas[1]))
        lp = gaussian_log_prob(pick("next_latents"), mean, std, self.cfg.logprob_reduce)
        stats = {"std": whole("std"), "schedule_std_mean": torch.tensor(self.schedule_std_mean)}
        if want("mean"):
            stats["mean"] = place(whole("old_mean"), mean)
        if want("velocity"):
            stats["velocity"] = place(v.new_zeros(len(index), mask.shape[1], *v.shape[1:]), v)
        if want("ratio_bias"):  # GRPO-Guard's b = reduce_d(dmu^2) / (2 std^2) per sample and step, dmu = mean - rollout's
            sq = (mean - pick("old_mean")).pow(2).flatten(1)
            sq = sq.mean(1) if self.cfg.logprob_reduce == "mean" else sq.sum(1)
            stats["ratio_bias"] = place(torch.zeros_like(old, dtype=lp.dtype), sq / (2 * std.clamp(min=1e-12) ** 2))
        return PolicyOutput(place(old.to(lp), lp), stats)

    @contextlib.contextmanager
    def reference(self):
        if not self.has_reference:
            raise RuntimeError("no reference model: set model.reference=auto to use a KL penalty")
        if self.lora:
            for _, tr in self.experts():
                tr.disable_adapters()
            try:
                yield
            finally:
                for _, tr in self.experts():
                    tr.enable_adapters()
        else:
            live = dict(self.experts())
            for name, ref in self._ref_copy.items():
                setattr(self.model, name, ref)
            try:
                with self._onload(list(self._ref_copy.values())):
                    yield
            finally:
                for name, tr in live.items():
                    setattr(self.model, name, tr)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.model.transformer

    def experts(self) -> list[tuple[str, torch.nn.Module]]:
        """(name, transformer) of the trained networks: the transformer, and Wan2.2's low-noise transformer_2."""
        return [(n, getattr(self.model, n)) for n in EXPERTS if getattr(self.model, n, None) is not None]

    def trainable_parameters(self):
        return [p for _, tr in self.experts() for p in tr.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------- several processes
    samples_rows = True  # sample(rows=...) gives any subset of a batch's rows

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [tr for _, tr in self.experts()]

    def parallelize(self, wrap, parallel: str) -> None:
        """DDP wraps each transformer (gradients all-reduced during backward); FSDP2 shards it in place. Every
        transformer call goes through the result; the frozen text encoders and VAE stay replicated. Two experts
        (Wan2.2) score in lockstep (`_lockstep`), so every rank issues the same collectives. FSDP2 also shards a
        frozen KL reference copy (full fine-tuning), which would otherwise be a whole replica on every GPU."""
        for name, tr in self.experts():
            setattr(self.model, name, wrap(tr))
        if self.model.transformer_2 is not None:
            self.model.lockstep = expert_lockstep(parallel, self.dist)
        if parallel in SHARDED and self._ref_copy is not None and not self.offload:
            self._ref_copy = {name: wrap(ref) for name, ref in self._ref_copy.items()}
        if self._pending:  # built on the meta device: each rank reads its shards, the reference copies them
            if parallel not in SHARDED:
                raise RuntimeError(f"transformers built on the meta device are loaded into FSDP shards; "
                                   f"train.parallel={parallel} has none")
            experts = dict(self.experts())
            for name in self._pending:
                load_into_shards(experts[name], os.path.join(self.model_path, name), self.device)
                if self.lora:
                    self._start_adapters(name, experts[name])
                if self._ref_copy is not None:
                    copy_shards(experts[name], self._ref_copy[name], self.device)
            self._pending = []

    def _start_adapters(self, name: str, tr: torch.nn.Module) -> None:
        """Expert `name`'s LoRA adapters at their start, whole or in their shards (init_adapters, its own seed)."""
        init_adapters(tr, self.lora_config.init_lora_weights, derive_seed(self.seed, "lora_init", EXPERTS.index(name)))

    def context_parallel(self, mesh, kind: str) -> None:
        """Each transformer (and a frozen KL reference copy) runs its calls split over the mesh's cp ranks through
        diffusers' context parallelism (mmrl/parallel/context_parallel.py); every rank of a cp group passes the same rows."""
        from mmrl.parallel.context_parallel import enable_context_parallel

        for tr in [tr for _, tr in self.experts()] + list((self._ref_copy or {}).values()):
            enable_context_parallel(tr, mesh["cp"].size(), mesh, kind)

    def enable_gradient_checkpointing(self) -> None:
        for _, tr in self.experts():
            tr.enable_gradient_checkpointing()

    @torch.no_grad()
    def evaluate(self, examples: list[dict], seed: int) -> torch.Tensor:
        texts, images = [ex["prompt"] for ex in examples], self.images(examples)
        enc, pooled = self.encode(texts, images)  # model.offload: the text encoders visit the device for this only
        neg = self._negative(len(texts), images) if self.cfg.eval_cfg_scale != 1.0 else None
        with self._onload(self.autoencoders):  # model.offload: the VAE visits the device to decode
            return self.model.generate(texts, [seed + i for i in range(len(texts))], self.cfg.eval_steps,
                                       self.cfg.eval_cfg_scale, self.cfg.shift, encoded=(enc, pooled, neg))

    # ---------------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, path: str) -> None:
        """LoRA: the peft adapter (adapter_model.safetensors + adapter_config.json) and the diffusers one
        (pytorch_lora_weights.safetensors); Wan2.2's transformer_2 adapter in transformer_2/ (diffusers:
        load_lora_weights(path/transformer_2, load_into_transformer_2=True)). Full fine-tuning: the whole model
        folder (loadable by load_flow_model) for the pixel model, else each transformer's weights."""
        write_policy_meta(path, "flow", self.model_path, self.lora, **self.model_options)
        for name, tr in self.experts():
            if self.lora:
                where = path if name == "transformer" else os.path.join(path, name)
                os.makedirs(where, exist_ok=True)
                save_diffusers_lora(getattr(self.model.family, "lora_pipeline", None),
                                    save_lora_adapter(tr, self.lora_config, where), self.lora_config, where)
            else:
                tr.save_pretrained(os.path.join(path, name))
        if not self.lora and self.model_path and os.path.isfile(os.path.join(self.model_path, "model_index.json")):
            _link_base_parts(self.model_path, path)

    def load_trainable_state(self, path: str) -> None:
        for name, tr in self.experts():
            if self.lora:
                load_lora_adapter(tr, path if name == "transformer" else os.path.join(path, name))
            else:
                _load_transformer_weights(tr, path, name)
