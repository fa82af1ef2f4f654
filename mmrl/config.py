"""Typed config: nested dataclasses are the single schema, with the checks of their values. YAML files and
`key=value` overrides are read into it by mmrl/config_files.py (`load_config`). Unknown keys and invalid values fail
with a message that names the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmrl.errors import ConfigError


@dataclass
class LoraConfig:
    enabled: bool = False         # LoRA via peft (the default for real checkpoints); False = full fine-tuning
    rank: int = 32
    alpha: int = 64
    # [] = the policy's default: flow = the model family's `lora_targets` (SD3: Flow-GRPO's joint attention
    # projections of every MMDiT block); token = attention and MLP projections of the language model (never vision)
    target_modules: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    policy: str = "flow"          # policy registry key (mmrl.policy.POLICIES): flow | token (alias vlm) | pkg.mod:build
    path: str = "tasks/assets/shapes-base"  # diffusers SD3 / FLUX / Wan pipeline folder or mmrl pixel-model folder
    family: str | None = None     # flow model family (mmrl/models/families): None = the one model_index.json's
                                  # class picks | a registered name | package.module:FAMILY (a user's own)
    dtype: str = "float32"        # float32 | bfloat16 (transformer weights; the SDE math is always fp32)
    device: str = "auto"          # auto = cuda if available else cpu
    sample_size: int | None = None  # latent size (H = W) override for diffusers pipelines (e.g. SD3 64 = 512 px)
    num_frames: int | None = None   # Wan: video frames (latent frames = (num_frames - 1) / 4 + 1); None = 81
    text_max_length: int | None = None  # T5 / UMT5 prompt tokens (None: the pipeline's, SD3 256, FLUX / Wan 512;
                                        # Flow-GRPO's SD3 recipes: 128)
    guidance: float = 3.5         # FLUX.1-dev guidance-embedding scale (FLUX distills CFG: keep sampler.cfg_scale 1)
    reference: str = "auto"       # KL reference: auto (adapters off with LoRA, else frozen copy) | none
    lora: LoraConfig = field(default_factory=LoraConfig)
    trust_remote_code: bool = False  # transformers models: run code shipped with a checkpoint only if you trust it
    freeze_vision: bool = True    # vlm full fine-tuning: keep the vision tower frozen
    shared_prefix: bool = True    # token policies: each prompt (with its media) runs once per group in scoring
    text_cache: int = 1024        # flow policies: prompt embeddings kept across iterations (frozen text encoders)
    offload: bool = False         # flow policies: text encoders and the KL reference copy wait on CPU and move to
                                  # the device only while they run (less memory, more host-device copies)


@dataclass
class SamplerConfig:
    kind: str = "flow_grpo"       # flow_grpo | dance | cps (docs/algorithms.md §1); ode only for forward-process
                                  # losses (algo.objective.name=awm | nft ...), which train on final samples, not steps
    num_steps: int = 10           # training-time denoising steps (Flow-GRPO: ~10 for training)
    noise_level: float = 0.7      # a: 0.7 SD3 (Flow-GRPO), 0.9 FLUX; DanceGRPO eta 0.3; CPS a
    cfg_scale: float = 4.0        # CFG in sampling AND in the log-prob recomputation (same scale)
    cfg_grad: str = "cond"        # the training gradient through CFG: cond = the unconditional branch detached
                                  # (Flow-GRPO's train_sd3.py) | full = through both branches
    shift: float = 1.0            # FlowMatchEulerDiscreteScheduler shift (SD3: 3.0)
    sde_window_size: int = 0      # SDE on a window of this many steps, ODE elsewhere; 0 = every trainable step
    sde_window_range: list[int] = field(default_factory=lambda: [0, -1])  # [lo, hi) window starts; -1 = last step
    logprob_reduce: str = "mean"  # mean over latent elements (Flow-GRPO reference) | sum (joint density)
    window_schedule: str = "random"  # random: a window start drawn per iteration in sde_window_range | sliding
                                  # (MixGRPO): the start moves one step later every window_shift_every iterations
    window_shift_every: int = 25
    ode_solver: str = "euler"     # ODE steps: euler | dpm2m (DPM-Solver++(2M) on the x0 prediction; MixGRPO-Flash)
    ode_stride: int = 1           # > 1: ODE runs outside the SDE window take every ode_stride-th sigma of the
                                  # schedule (fewer transformer calls; MixGRPO-Flash); the window's steps are unchanged
    forward_timesteps: int = 2    # forward-process losses: noise levels t per final sample (the trained actions)
    forward_t_range: list[float] = field(default_factory=lambda: [0.0, 1.0])  # t ~ U(lo, hi)
    shared_noise: bool = False    # the samples of a group start from one initial noise (DanceGRPO): reward
                                  # differences within a group then come from the trained SDE steps alone
    branch_children: int = 0      # > 0: TempFlow-GRPO per-step branching (mmrl/rollout/step_branch.py): one ODE trunk
                                  # per prompt and, at every step of the SDE window (size 0: every trainable step),
                                  # this many SDE children finished by ODE; train.group_size = children x window steps
    eval_steps: int = 16          # ODE steps for evaluation
    eval_cfg_scale: float = 4.0
    # token policies (vlm): sampling of completions; evaluation decodes greedily
    temperature: float = 1.0      # log-probs are taken at this temperature too
    top_p: float = 1.0
    max_new_tokens: int = 64
    engine: str = "prefix_cache"  # token policies: prefix_cache (each prompt prefilled once per group) | hf (generate)
                                  # | vllm (mmrl/rollout/vllm_engine.py: text LMs and Qwen-VL; vLLM in this environment)
    # VLLMEngine options (mmrl/rollout/vllm_engine.py OPTIONS): dtype (auto: the model's 16-bit dtype, else bfloat16
    # on CUDA, float32 on CPU), eager (default: CUDA graphs on CUDA; CPU always eager), sleep + sleep_level (1 | 2,
    # CUDA only), gpu_memory_utilization, max_model_len, seed
    vllm: dict = field(default_factory=dict)


@dataclass
class TreeConfig:
    """BranchGRPO tree rollouts for flow policies (mmrl/rollout/tree.py; docs/algorithms.md §3); off while split_steps
    is empty. With sampler.sde_window_size > 0 it is BranchGRPO-Mix: SDE on that window (drawn as for the
    chain) and on the split steps, ODE elsewhere, only SDE edges trained."""
    split_steps: list[int] = field(default_factory=list)  # every path branches here, e.g. [0, 3, 6, 9] of 20 steps
    split_rounds: int = 0         # > 0: split_steps = evenly spaced rounds i * (num_steps // split_rounds), i < rounds
                                  # (reference: --tree_split_rounds; 4 of 20 steps = [0, 5, 10, 15]), resolved at load
    branch: int = 2               # children per split; train.group_size must be branch ** len(split_steps)
    split_noise_scale: float = 1.0  # split-step noise std x this (reference: 4.0); the log-prob uses that std
    fusion: str = "mean"          # node reward: mean of its leaves | softmax (children by softmax(alpha * logp(edge)))
    fusion_alpha: float = 1.0
    # Pruning (BranchGRPO's train_one_step_tree; docs/algorithms.md §3) only removes transitions from training.
    # Step indices throughout: the reference's --depth_pruning lists CHILD DEPTHS, depth = step + 1.
    prune_steps: list[int] = field(default_factory=list)  # depth pruning: these steps' transitions are not trained
                                  # (reference: --depth_pruning = these + 1)
    prune_slide_every: int = 0    # > 0: the pruned steps move one step earlier every this many iterations, shift =
                                  # (iteration + 1) // this (the reference counts steps from 1), until the shallowest
                                  # reaches prune_slide_stop (reference: --depth_pruning_slide_interval)
    prune_slide_stop: int | None = None  # the step the shallowest pruned step stops at; None = last split - 1, so
                                  # late in training the window prunes the step before the last split and on
                                  # (reference: --depth_pruning_stop_depth = this + 1, default depth = last split)
    prune_iter_ratio: float = 1.0  # prune (depth and width) only while iteration + 1 <= int(train.iterations x this)
                                  # (reference: --pruning_step_ratio); 1 = every iteration
    width_prune: int = 0          # on each leaf's transitions after the last split, counted after depth pruning and
                                  # counting the last step (an SDE edge in the reference, never trained here):
                                  # 0 off | 1 each leaf keeps its first max(1, int(n x width_ratio)) of those n |
                                  # 2 of all of them in the batch, ranked by advantage, the best max(2, int(n x
                                  # width_ratio)) // 2 and the worst rest are kept (reference: --width_pruning_mode)
    width_ratio: float = 0.5      # reference: --width_pruning_ratio


@dataclass
class VideoConfig:
    """Video input of token policies (qwen-vl-utils; mmrl/video.py)."""
    backend: str = "decord"       # decord | torchcodec
    fps: float | None = 2.0       # sampled frames per second (ignored when nframes is set)
    nframes: int | None = None
    min_pixels: int | None = None  # per frame; None = qwen-vl-utils' default
    max_pixels: int | None = None
    total_pixels: int | None = None
    on_error: str = "raise"       # missing / corrupt video: raise (naming the file) | skip (counted, logged)
    cache_size: int = 512         # decoded videos (and processed prompts) kept in memory, at most ...
    cache_mb: float = 2048        # ... and at most this many MiB of tensors each (float32 frames are large)
    prefetch_workers: int = 2     # threads decoding the next batch's videos while this one samples (tasks whose
                                  # sample() reads only its rng: `samples_ahead`); 0 = decode on the training thread


@dataclass
class TaskConfig:
    name: str = "shapes"          # task registry key (mmrl.task.TASKS)
    split: str = "train"          # texts GRPO trains on (shapes: train texts; held-out never seen)
    prompt_file: str | None = None  # for name=prompt_file: .txt (a prompt per line), .jsonl / .csv / .tsv (a prompt
                                    # field and metadata); or task.kwargs.dataset (docs/extending.md)
    eval_split: str = "heldout"
    eval_prompts: int = 240       # held-out evaluation prompts (balanced over categories)
    kwargs: dict = field(default_factory=dict)  # task-specific options (e.g. grounding: format, annotations ...)


@dataclass
class RewardConfig:
    name: str = "shapes"          # reward registry key (mmrl.reward.REWARDS)
    kwargs: dict = field(default_factory=dict)
    on_error: str = "skip"        # skip: a sample whose reward raises / is NaN is counted and excluded | raise
    eval_name: str = ""           # reward for held-out evaluation; "" = the training reward (a pairwise training
    eval_kwargs: dict = field(default_factory=dict)  # reward has no per-sample score: name the gold one here)
    workers: int = 0              # > 0: score rollout chunks in a thread pool while the next chunk samples
    overlap_chunks: int = 2       # chunks the prompts of one iteration are sampled in when workers > 0
    max_failed_fraction: float = 0.5  # an iteration whose failed (raised / NaN) samples exceed this fraction stops
                                      # the run: a reward that cannot score the task's outputs trains nothing


@dataclass
class ObjectiveConfig:
    """What a training pass minimizes (mmrl/algorithms/objective.py): the policy loss, named once with its own knobs,
    and the terms only some recipes add. A loss's knobs are the fields of the dataclass declared beside it (fn.knobs,
    e.g. NFTKnobs in mmrl/algorithms/losses.py), checked at load; a knob that several components read (clip_range,
    clip_range_high, clip_ratio_c, adv_clip) is an algo.* key instead (mmrl/algorithms/knobs.py)."""
    name: str = "ppo_clip"        # POLICY_LOSSES key: ppo_clip | awm | awm_anchored | nft | dgpo | dpo | flow_dppo |
                                  # package.module:fn (a user's own)
    kwargs: dict = field(default_factory=dict)  # the loss's own knobs, e.g. {nft_beta: 2.0}; unset ones: defaults
    tis_cap: float = 0.0          # truncated importance sampling (token policies): each action's loss times
                                  # min(pi_old / pi_engine, tis_cap), pi_engine the sampling engine's own log-prob
                                  # (vLLM, bf16 decoding); 0 = off; typical 2
    sft_coef: float = 0.0         # > 0: add sft_coef x the NLL of the injected rows to their loss (supervised anchor,
                                  # with algo.offpolicy=ground_truth)


@dataclass
class ShapingConfig:
    """The reward shaping applied to the overall reward before advantages (mmrl/algorithms/shaping.py), named once
    with its own knobs (the dataclass beside it, fn.knobs), e.g. {name: tempsamp, kwargs: {tau: 0.8, alpha: 1.0}}."""
    name: str = "none"            # REWARD_SHAPINGS key: none | tempsamp (TempSamp-R1) | tgrpo (T-GRPO) | pkg.mod:fn
    kwargs: dict = field(default_factory=dict)


@dataclass
class AlgoConfig:
    advantage: str = "grpo"       # ADVANTAGES key
    global_std: bool = False      # normalize by the batch std instead of the group std
    adv_std: str = "auto"         # the group std: population (ddof 0; flow_grpo) | sample (ddof 1; verl, TRL); auto =
                                  # the policy kind's (mmrl/policy/kinds.py: flow population, token sample), resolved at load
    adv_eps: float | None = None  # added to the std; None = the chosen std's reference: population 1e-4, sample 1e-6
    adv_clip: float = 5.0         # |A| <= 5 (Flow-GRPO); also DiffusionNFT's normalization of A (objective nft)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # the policy loss {name, kwargs} and terms
    # PPO's trust region, shared by the ratio-clipped losses (ppo_clip, awm, awm_anchored, dgpo): set here, once
    clip_range: float = 1e-4      # Flow-GRPO SD3 with mean-reduced log-probs: 1e-4
    clip_range_high: float | None = None  # DAPO clip-higher; None = clip_range
    clip_ratio_c: float = 3.0     # dual-clip PPO (verl's clip_ratio_c): for A < 0 the loss is at most -c A; 0 = off
    loss_agg: str = "seq_mean_token_mean"  # LOSS_AGG key
    kl: str = "auto"              # KL_ESTIMATORS key (used when kl_coef > 0); auto = the first of flow_mean,
                                  # flow_velocity, k3 whose reads the policy provides (resolved at load)
    kl_coef: float = 0.0          # beta; Flow-GRPO GenEval: 0.004 .. 0.04; GRPO-Guard: 0
    kl_reference: str = "base"    # the KL's reference: base (the frozen initial model) | ema (the EMA of the trained
                                  # weights, train.ema_decay, which evaluation also uses)
    weighting: str = "none"       # WEIGHTINGS key, or keys joined by "+" whose weights multiply (tempflow+guard_dt)
    tempflow_constant: float | None = None  # weighting tempflow: w_t = this x std_t (the official code's constant:
                                  # 2.25 SD3 at 10 steps, 1.73 FLUX); null = std_t / the schedule's mean std
    ratio: str = "none"           # RATIO_TRANSFORMS key: none | gspo (sequence-level ratio)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)  # reward shaping {name, kwargs} before advantages
    reward_aggregation: str = "sum"  # REWARD_AGGREGATIONS key for several rewards (reward.name=multi): sum | gdpo |
                                     # batch | per_reward (Pref-GRPO's weighted per-reward group z-scores)
    offpolicy: str = "none"       # OFFPOLICY key: none | ground_truth (TempSamp-R1 injection, one row per group)
    dynamic_sampling: bool = False  # DAPO: resample prompts whose group has zero reward std
    dynamic_sampling_tries: int = 3  # extra sampling rounds at most per iteration
    credit: str = "auto"          # CREDIT_ASSIGNMENTS key: group | tree | step_branch | pkg.mod:fn; auto = tree when
                                  # tree.split_steps, step_branch when sampler.branch_children


SHARDED = ("fsdp", "hsdp")  # train.parallel values whose weights are FSDP2 DTensor shards (sharded checkpoints,
                            # meta-device loading into shards, lockstep forwards): all ranks, or a node's ranks


@dataclass
class TrainConfig:
    iterations: int = 100
    prompts_per_iter: int = 8     # B
    group_size: int = 8           # G
    inner_epochs: int = 1
    minibatches: int = 1          # minibatches per epoch (optimizer steps = minibatches / grad_accum)
    grad_accum: int = 1
    lr: float = 1e-4
    lr_warmup: int = 0            # iterations of linear warm-up from 0
    lr_cooldown: float = 0.0      # last fraction of the run (by iterations, or by time_budget_min when that
                                  # ends it first) over which the lr decays linearly to 0; 0 = constant lr
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ema_decay: float = 0.0        # 0 = off; else EMA of trainable weights, used for eval and saved
    sampling_ema: list[float] = field(default_factory=list)  # [rate, cap]: rollouts sample with a soft-updated copy
                                  # of the weights (DiffusionNFT's old policy), theta_old <- eta theta_old + (1 - eta)
                                  # theta once per iteration, eta = min(rate x iteration, cap); [] = the current weights
    seed: int = 0
    zero_signal_patience: int = 5  # warn when this many iterations in a row have all-zero advantages (nothing learned)
    threads: int | str = "auto"   # torch CPU threads: auto = the cores other processes leave free (the load average,
                                  # re-read every iteration; OMP_NUM_THREADS set: that), a count, or 0 = torch's.
                                  # CPU sums depend on the thread count: set a count for bit-identical reruns
    time_budget_min: float = 0.0  # stop after this many minutes of training (0 = no limit)
    parallel: str = "none"        # several processes (torchrun / accelerate launch): ddp | fsdp (FSDP2 fully_shard
                                  # over all ranks) | hsdp (hybrid: FSDP2 shards within a node of train.shard_size
                                  # ranks, replicas across nodes, on a 2-D ("replicate", "shard") mesh)
    shard_size: int = 0           # hsdp: ranks that share one copy of the weights (a node); 0 = the launcher's
                                  # processes per node (LOCAL_WORLD_SIZE, torchrun --nproc_per_node)
    context_parallel: int = 1     # flow video DiTs: ranks that split one forward's video tokens (diffusers' context
                                  # parallelism); the world is dp x cp, whole groups go to the dp ranks
    cp_kind: str = "ulysses"      # ulysses (all-to-all of heads) | ring (K/V rotation; flash-type GPU backends)
    mixed_precision: str = "no"   # bf16: training forward in bf16 (autocast; FSDP: bf16 params, fp32 reduction) | no
    tf32: bool = True             # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs,
                                  # fp32 accumulation: 7-8x the fp32 rate of A100 / H100); false = IEEE fp32
    gradient_checkpointing: bool = False  # recompute activations in backward (the trained transformer / LM)
    compile: bool = False         # torch.compile the trained networks' repeated transformer blocks in place, for
                                  # sampling and training (regional compilation, as diffusers' compile_repeated_blocks;
                                  # mmrl/compiled.py); the first calls of each shape compile (seconds to minutes)
    micro_batch: int | str = 0    # rows per model forward, bounding peak memory: in training (flow: transitions,
                                  # token: sequences; gradients accumulate to the whole minibatch's), sampling,
                                  # VAE decoding and old log-probs. 0 = a whole minibatch / rollout at once; auto = the
                                  # largest that fits the device by `mmrl plan` (mmrl/micro_batch.py; resolved by
                                  # `mmrl train`, other commands then use train.sample_chunk or all rows at once)
    sample_chunk: int = -1        # rows per forward without gradients (sampling, old log-probs, reward scoring,
                                  # evaluation; a VAE decodes what fits half the free memory); -1 = train.micro_batch,
                                  # 0 = all at once
    dist_timeout_min: float = 30.0  # several processes: minutes a collective waits for the slowest rank before the
                                  # job fails (NCCL's own default, 10, can trip during a slow judge's evaluation)
    ratio_warn: float = 0.05      # warn when the first pass's mean |ratio - 1| (rollout vs trainer log-probs under the
                                  # same weights, logged as train/first_ratio_dev) exceeds this; 0 = never


def sample_chunk(t: TrainConfig) -> int:
    """Rows per forward without gradients: train.sample_chunk, or train.micro_batch when it is -1 (an unresolved
    `auto`: all at once)."""
    if t.sample_chunk >= 0:
        return t.sample_chunk
    return 0 if t.micro_batch == "auto" else t.micro_batch


@dataclass
class LogConfig:
    out_dir: str = "runs/shapes_grpo"
    tensorboard: bool = True
    report_to: list[str] = field(default_factory=list)  # more trackers beside TensorBoard: wandb, mlflow (docs/trackers.md)
    image_every: int = 10         # iterations between image grids; 0 = none
    eval_every_min: float = 0.0   # > 0: also evaluate each time this many minutes of the run have passed (the
                                  # evaluations count in train.time_budget_min); results.json lists them
    save_every: int = 20          # iterations between checkpoints (and one at the end); 0 = only at the end
    keep_checkpoints: int = 2     # newest checkpoints kept; older ones are deleted after a successful save
    eval_every: int = 0           # iterations between held-out evals (0 = at start and end only)
    eval_at_start: bool = True
    eval_draws: int = 1           # noise draws per held-out evaluation (seeds 10000 ... 10000+K-1): each example
                                  # scores its mean over them, and "draws" lists each draw's mean (mmrl eval --draws)
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)

    def validate(self) -> "Config":
        """Check values and their combinations; raise ValueError naming the key and the fix. Registry names
        (policy, task, reward, algorithm pieces) are checked where they are resolved: mmrl.compose.check_choices."""
        self._resolve_split_rounds()  # before anything reads tree.split_steps
        self._validate_reward()
        choice("video.backend", self.video.backend, ("decord", "torchcodec"))
        choice("video.on_error", self.video.on_error, ("raise", "skip"))
        if self.video.prefetch_workers < 0:
            raise ConfigError(f"video.prefetch_workers must be >= 0 (0 = no background decoding), got "
                              f"{self.video.prefetch_workers}")
        choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16"))
        choice("model.reference", self.model.reference, ("auto", "none"))
        self._validate_train()
        self._validate_algo()
        self._validate_sampler()
        self._validate_tree()
        self._validate_ranges()
        if self.log.eval_draws < 1:
            raise ConfigError(f"log.eval_draws={self.log.eval_draws}: evaluate each example at least once (1 or more)")
        if self.task.name == "prompt_file" and not self.task.prompt_file and not self.task.kwargs.get("dataset"):
            raise ConfigError("task.name=prompt_file needs task.prompt_file=PATH (.txt one prompt per line, .jsonl / .csv "
                              "with a prompt field) or task.kwargs.dataset=NAME_OR_FOLDER (Hugging Face datasets)")
        return self

    # numeric keys and their ranges, checked at load: (key, lowest, highest, lowest allowed: True = inclusive)
    RANGES = [("train.lr", 0, None, False), ("train.lr_warmup", 0, None, True), ("train.lr_cooldown", 0, 1, True),
              ("train.weight_decay", 0, None, True), ("train.max_grad_norm", 0, None, False),
              ("train.zero_signal_patience", 0, None, True), ("train.threads", 0, None, True),
              ("train.time_budget_min", 0, None, True), ("train.shard_size", 0, None, True),
              ("train.ratio_warn", 0, None, True), ("log.image_every", 0, None, True), ("log.save_every", 0, None, True),
              ("log.keep_checkpoints", 1, None, True), ("log.eval_every", 0, None, True),
              ("log.eval_every_min", 0, None, True), ("sampler.noise_level", 0, None, True),
              ("sampler.cfg_scale", 0, None, True), ("sampler.eval_cfg_scale", 0, None, True),
              ("sampler.eval_steps", 1, None, True), ("sampler.branch_children", 0, None, True),
              ("sampler.temperature", 0, None, True), ("sampler.top_p", 0, 1, False),
              ("sampler.max_new_tokens", 1, None, True), ("task.eval_prompts", 0, None, True)]

    def _validate_ranges(self) -> None:
        """Every numeric key of RANGES within its range, the error naming the key, the range and what 0 means."""
        if isinstance(self.train.threads, str) and self.train.threads != "auto":
            raise ConfigError(f"train.threads={self.train.threads!r}: use auto (the free cores), a count, or 0")
        for key, lo, hi, inclusive in self.RANGES:
            section, name = key.split(".")
            v = getattr(getattr(self, section), name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # a type error is the loader's; "auto" values are resolved elsewhere
            if (v < lo if inclusive else v <= lo) or (hi is not None and v > hi):
                span = f"{'>=' if inclusive else '>'} {lo}" + (f" and <= {hi}" if hi is not None else "")
                off = _ZERO_MEANS.get(key)
                raise ConfigError(f"{key}={v}: must be {span}" + (f" (0 = {off})" if off else ""))

    def _validate_reward(self) -> None:
        if self.reward.name == "pairwise" and not self.reward.eval_name:
            raise ConfigError("reward.name=pairwise scores samples only against their group: set reward.eval_name "
                              "(e.g. shapes) for the held-out evaluation")
        agg = self.algo.reward_aggregation
        if agg in ("gdpo", "batch", "per_reward"):
            if self.reward.name != "multi":
                raise ConfigError(f"algo.reward_aggregation={agg} normalizes each of several rewards: set "
                                  "reward.name=multi with reward.kwargs.components, or algo.reward_aggregation=sum")
            if self.algo.shaping.name != "none" or self.tree.split_steps:
                raise ConfigError(f"algo.reward_aggregation={agg} does not combine with algo.shaping or tree "
                                  "rollouts: use algo.reward_aggregation=sum")
        if not 0 <= self.reward.max_failed_fraction <= 1:
            raise ConfigError(f"reward.max_failed_fraction must be in [0, 1], got {self.reward.max_failed_fraction}")
        if self.reward.workers < 0 or self.reward.overlap_chunks < 1:
            raise ConfigError("reward.workers must be >= 0 and reward.overlap_chunks >= 1")
        if self.reward.workers and self.tree.split_steps:
            raise ConfigError("tree rollouts sample each prompt's tree in one pass: set reward.workers=0")
        choice("reward.on_error", self.reward.on_error, ("skip", "raise"))

    def _validate_train(self) -> None:
        t = self.train
        choice("train.parallel", t.parallel, ("none", "ddp", *SHARDED))
        if t.shard_size < 0:
            raise ConfigError(f"train.shard_size must be >= 0 (0 = the processes of one node), got {t.shard_size}")
        if t.shard_size and t.parallel != "hsdp":
            raise ConfigError(f"train.shard_size={t.shard_size} sets the shard group of train.parallel=hsdp; with "
                              f"train.parallel={t.parallel} set train.shard_size=0 (or train.parallel=hsdp)")
        choice("train.mixed_precision", t.mixed_precision, ("no", "bf16"))
        choice("train.cp_kind", t.cp_kind, ("ulysses", "ring"))
        if t.context_parallel < 1:
            raise ConfigError(f"train.context_parallel must be >= 1 (1 = off), got {t.context_parallel}")
        if t.compile and t.context_parallel > 1:
            raise ConfigError("train.compile with train.context_parallel > 1: the compiled blocks would trace context "
                              "parallelism's sequence-splitting hooks, which is untested; set train.compile=false")
        if t.dist_timeout_min <= 0:
            raise ConfigError(f"train.dist_timeout_min must be > 0 minutes (how long a collective waits for the slowest "
                              f"rank), got {t.dist_timeout_min}")
        if t.group_size < 2:
            raise ConfigError(f"train.group_size={t.group_size}: group-relative advantages need >= 2 samples per group")
        for k in ("iterations", "prompts_per_iter", "inner_epochs", "minibatches", "grad_accum"):
            if getattr(t, k) < 1:
                raise ConfigError(f"train.{k} must be >= 1, got {getattr(t, k)}")
        n = t.prompts_per_iter * t.group_size
        if n % t.minibatches:
            raise ConfigError(f"train.minibatches={t.minibatches} must divide prompts_per_iter * group_size = {n}")
        if t.minibatches % t.grad_accum:
            raise ConfigError(f"train.grad_accum={t.grad_accum} must divide train.minibatches={t.minibatches}")
        if self.model.dtype != "float32" and not self.model.lora.enabled and t.mixed_precision == "no":
            raise ConfigError(f"model.dtype={self.model.dtype} with full fine-tuning: the trained weights are kept in "
                              f"fp32 (master weights), so set train.mixed_precision=bf16 to compute in bf16, or enable "
                              f"model.lora (the adapter is fp32, the frozen base stays {self.model.dtype})")
        if t.micro_batch != "auto" and (isinstance(t.micro_batch, str) or t.micro_batch < 0):
            raise ConfigError(f"train.micro_batch must be >= 0 (0 = no split) or auto, got {t.micro_batch!r}")
        if t.sample_chunk < -1:
            raise ConfigError(f"train.sample_chunk must be >= 0, or -1 for train.micro_batch; got {t.sample_chunk}")
        if not 0 <= t.ema_decay < 1:
            raise ConfigError(f"train.ema_decay must be in [0, 1), got {t.ema_decay}")
        if t.sampling_ema and (len(t.sampling_ema) != 2 or t.sampling_ema[0] < 0 or not 0 <= t.sampling_ema[1] < 1):
            raise ConfigError(f"train.sampling_ema must be [rate, cap] with rate >= 0 and 0 <= cap < 1 (DiffusionNFT: "
                              f"[0.001, 0.5]), or [] for the current weights; got {t.sampling_ema}")

    def _validate_algo(self) -> None:
        choice("algo.adv_std", self.algo.adv_std, ("auto", "population", "sample"))
        if self.algo.clip_ratio_c and self.algo.clip_ratio_c <= 1:
            raise ConfigError(f"algo.clip_ratio_c must be > 1 (dual-clip bound on -A r for A < 0; verl uses 3) or 0 "
                              f"(off), got {self.algo.clip_ratio_c}")
        if self.algo.clip_range <= 0:
            raise ConfigError(f"algo.clip_range must be > 0, got {self.algo.clip_range}")
        self._validate_objective_terms()
        if self.algo.kl_coef > 0 and self.model.reference == "none":
            raise ConfigError("algo.kl_coef > 0 needs a reference model: set model.reference=auto or algo.kl_coef=0")
        choice("algo.kl_reference", self.algo.kl_reference, ("base", "ema"))
        if self.algo.kl_reference == "ema" and self.algo.kl_coef > 0 and self.train.ema_decay == 0:
            raise ConfigError("algo.kl_reference=ema takes the EMA of the trained weights as the reference: set "
                              "train.ema_decay (e.g. 0.9), or algo.kl_reference=base")

    def _validate_sampler(self) -> None:
        s = self.sampler
        if len(s.sde_window_range) != 2:
            raise ConfigError(f"sampler.sde_window_range must be [lo, hi) window starts, e.g. [0, 4]; got "
                             f"{s.sde_window_range}")
        choice("sampler.logprob_reduce", s.logprob_reduce, ("mean", "sum"))
        choice("sampler.cfg_grad", s.cfg_grad, ("cond", "full"))
        if s.num_steps < 2:
            raise ConfigError(f"sampler.num_steps must be >= 2 (the last step is never trained), got {s.num_steps}")
        if s.sde_window_size < 0 or s.sde_window_size > s.num_steps - 1:
            raise ConfigError(f"sampler.sde_window_size must be in [0, num_steps - 1 = {s.num_steps - 1}], "
                              f"got {s.sde_window_size}")
        choice("sampler.window_schedule", s.window_schedule, ("random", "sliding"))
        choice("sampler.ode_solver", s.ode_solver, ("euler", "dpm2m"))
        if s.ode_stride < 1 or s.window_shift_every < 1 or s.forward_timesteps < 1:
            raise ConfigError("sampler.ode_stride, sampler.window_shift_every and sampler.forward_timesteps must be >= 1")
        r = s.forward_t_range
        if len(r) != 2 or not 0 <= r[0] < r[1] <= 1:
            raise ConfigError(f"sampler.forward_t_range must be [lo, hi] with 0 <= lo < hi <= 1, got {s.forward_t_range}")
        if s.branch_children:
            self._validate_branching()

    def _validate_branching(self) -> None:
        s, k = self.sampler, self.sampler.branch_children
        steps = s.sde_window_size or s.num_steps - 1  # branch steps per prompt (Wan2.2: a window in each expert's steps)
        if k < 2 or self.train.group_size % k or self.train.group_size // k not in (steps, 2 * steps):
            raise ConfigError(f"sampler.branch_children={k} children at each of {steps} branch steps give "
                              f"{k * steps} rows per prompt: set train.group_size={k * steps} (two experts, Wan2.2: "
                              f"{2 * k * steps}), branch_children >= 2 (the children of a step are its group)")
        if self.tree.split_steps:
            raise ConfigError("sampler.branch_children (TempFlow per-step branching) and tree.split_steps (BranchGRPO) "
                              "are two rollout shapes: set one")
        if s.ode_stride != 1 or s.ode_solver != "euler" or s.kind == "ode":
            raise ConfigError("sampler.branch_children runs an Euler ODE trunk and SDE children: set sampler.ode_stride=1, "
                              "sampler.ode_solver=euler and an SDE sampler.kind (flow_grpo, dance, cps)")
        if self.algo.credit not in ("auto", "step_branch"):
            raise ConfigError(f"sampler.branch_children gives each child one action whose group is its prompt's step: "
                              f"set algo.credit=auto (step_branch), got {self.algo.credit!r}")


    def _validate_objective_terms(self) -> None:
        """algo.objective's terms against the rest (the loss's own knobs are checked by its dataclass at load)."""
        o, key = self.algo.objective, "algo.objective"
        if o.tis_cap < 0 or 0 < o.tis_cap < 1:
            raise ConfigError(f"{key}.tis_cap must be 0 (off) or >= 1 (a cap on pi_old / pi_engine), got {o.tis_cap}")
        if o.tis_cap and self.sampler.engine == "hf":
            raise ConfigError(f"{key}.tis_cap needs the sampling engine's log-probs, which sampler.engine=hf does not "
                              f"record: use sampler.engine=prefix_cache or vllm, or set {key}.tis_cap=0")
        if o.sft_coef < 0:
            raise ConfigError(f"{key}.sft_coef must be >= 0, got {o.sft_coef}")
        if o.sft_coef > 0 and self.algo.offpolicy == "none":
            raise ConfigError(f"{key}.sft_coef > 0 trains the NLL of injected rows, and there are none: set "
                              f"algo.offpolicy=ground_truth or {key}.sft_coef=0")

    def _validate_tree(self) -> None:
        tr = self.tree
        choice("tree.width_prune", tr.width_prune, (0, 1, 2))
        if not tr.split_steps:
            return
        leaves = tr.branch ** len(tr.split_steps)
        if tr.branch < 2 or self.train.group_size != leaves:
            raise ConfigError(f"tree rollouts give branch ** len(split_steps) = {leaves} leaves per prompt: set "
                              f"train.group_size={leaves} (got {self.train.group_size}), branch >= 2")
        if self.algo.loss_agg != "token_mean":
            raise ConfigError("tree rollouts train each transition once, owned by one leaf: set algo.loss_agg=token_mean "
                              "(the mean over transitions, as BranchGRPO)")
        if not 0 < tr.width_ratio <= 1:
            raise ConfigError(f"tree.width_ratio must be in (0, 1], got {tr.width_ratio}")
        if not 0 <= tr.prune_iter_ratio <= 1:
            raise ConfigError(f"tree.prune_iter_ratio must be in [0, 1] (the fraction of train.iterations that prunes; "
                              f"1 = every iteration), got {tr.prune_iter_ratio}")
        if tr.prune_slide_every < 0:
            raise ConfigError(f"tree.prune_slide_every must be >= 0 (0 = fixed pruned steps), got {tr.prune_slide_every}")
        if tr.prune_slide_stop is not None:
            if not (tr.prune_steps and tr.prune_slide_every > 0):
                raise ConfigError("tree.prune_slide_stop ends a sliding depth-pruning window: set tree.prune_steps and "
                                  "tree.prune_slide_every > 0, or tree.prune_slide_stop=null")
            if not 0 <= tr.prune_slide_stop <= min(tr.prune_steps):
                raise ConfigError(f"tree.prune_slide_stop={tr.prune_slide_stop} is a step index in [0, min(prune_steps) "
                                  f"= {min(tr.prune_steps)}] (the reference's --depth_pruning_stop_depth minus 1)")
        bad = [s for s in tr.prune_steps if not 0 <= s < self.sampler.num_steps]
        if bad:
            raise ConfigError(f"tree.prune_steps={tr.prune_steps} are step indices in [0, num_steps - 1 = "
                              f"{self.sampler.num_steps - 1}] (the reference's --depth_pruning lists depths = step + 1)")

    def _resolve_split_rounds(self) -> None:
        """tree.split_rounds -> tree.split_steps (BranchGRPO's parse_split_points): rounds i * (num_steps // rounds)."""
        tr, n = self.tree, self.sampler.num_steps
        if tr.split_rounds < 0:
            raise ConfigError(f"tree.split_rounds must be >= 0 (0 = use tree.split_steps), got {tr.split_rounds}")
        if not tr.split_rounds:
            return
        steps = [i * (n // tr.split_rounds) for i in range(tr.split_rounds)]
        if len(set(steps)) != len(steps) or steps[-1] > n - 2:
            raise ConfigError(f"tree.split_rounds={tr.split_rounds} gives splits {steps} of sampler.num_steps={n}: "
                              f"need distinct steps <= num_steps - 2 = {n - 2}; use fewer rounds or tree.split_steps")
        if tr.split_steps and tr.split_steps != steps:
            raise ConfigError(f"tree.split_rounds={tr.split_rounds} means split_steps={steps}, but tree.split_steps="
                              f"{tr.split_steps}: set one of them")
        tr.split_steps = steps


_ZERO_MEANS = {"train.threads": "torch's default", "train.time_budget_min": "no limit", "log.image_every": "none",
               "log.save_every": "only at the end", "log.eval_every": "at start and end only",
               "log.eval_every_min": "off", "train.zero_signal_patience": "never warn", "train.ratio_warn": "never",
               "train.shard_size": "the processes per node", "train.lr_cooldown": "a constant lr"}


def choice(key: str, value: Any, valid: tuple) -> None:
    """ConfigError naming `key`, the closest valid value and all of them, unless value is one of `valid`."""
    if value not in valid:
        import difflib

        close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: invalid value {value!r}; valid: {list(valid)}{hint}")



def flat(d: dict, prefix: str = "", whole: tuple[str, ...] = ()) -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty dicts, and dicts under a key in `whole` (e.g. reward.kwargs), stay leaves."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in whole:
            out.update(flat(v, f"{prefix}{k}.", whole))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
