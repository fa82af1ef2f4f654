"""The Policy protocol: the one interface the trainer talks to, for every modality."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Protocol, runtime_checkable

import torch

from mmrl.data import PolicyOutput, Rollout
from mmrl.errors import ConfigError, MissingFile


@runtime_checkable
class Policy(Protocol):
    """Exactly what the trainer, the algorithms, checkpoints and `mmrl eval` use. Subclass `PolicyDefaults` to
    get the optional members; `mmrl.testing.contract.check_policy` checks a policy against this contract."""

    device: torch.device        # where its trained weights live; the loss runs there
    samples_rows: bool          # sample(rows=...) gives any subset of a batch's rows (several processes)
    scores_actions: bool        # log_prob(actions=...) recomputes only those actions (micro-batches of transitions)
    defer_old_log_prob: bool    # set by the trainer: sample may return NaN old log-probs, filled by its first forward

    def sample(self, examples: list[dict], group_size: int, generator: torch.Generator) -> Rollout:
        """Sample group_size outputs per example: a Rollout of N = len(examples) * group_size rows."""

    def log_prob(self, rollout: Rollout, index: torch.Tensor) -> PolicyOutput:
        """Recompute log-probs [n, A] (with grad) of the stored actions of rows `index` [n]."""

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which log_prob runs the KL reference (adapters disabled, or a frozen copy)."""

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def trainable_modules(self) -> list[torch.nn.Module]:
        """The trained networks (DDP / FSDP wrap them; checkpoints gather them)."""

    def parallelize(self, wrap, parallel: str) -> None:
        """Route every forward of the trained networks through `wrap(module)` (DDP / FSDP2)."""

    def context_parallel(self, mesh, kind: str) -> None:
        """train.context_parallel: split every forward of the trained networks' sequence over mesh["cp"]."""

    def enable_gradient_checkpointing(self) -> None: ...

    def sync_weights(self) -> None:
        """After an iteration's optimizer steps: a rollout engine with its own weight copy (vLLM) reloads."""

    def replace_outputs(self, rollout: Rollout, rows: torch.Tensor, outputs: list) -> Rollout:
        """Off-policy injection (TempSamp-R1): rows' outputs replaced by given ones, their old log-probs recomputed."""

    def save_pretrained(self, path: str) -> None: ...

    def load_trainable_state(self, path: str) -> None:
        """Load trainable weights written by save_pretrained (mmrl eval)."""

    @torch.no_grad()
    def evaluate(self, examples: list[dict], seed: int) -> object:
        """Deterministic evaluation outputs (ODE samples, greedy answers), one per example."""


class PolicyDefaults:
    """The optional members of `Policy` with their defaults, for a policy to subclass."""

    samples_rows = False
    scores_actions = False
    defer_old_log_prob = False
    iteration = 0  # the trainer's iteration, set before each rollout (schedules that move with training read it)
    dist = None    # mmrl.parallel.distributed.Distributed of a multi-process run (set by the trainer before parallelize)
    reads = None   # the PolicyOutput.stats the trainer's objective reads (Objective.reads; None: all): a policy may
                   # build only these

    def sync_weights(self) -> None:
        pass

    def prefetch(self, examples: list[dict]) -> None:
        """Start loading the media of examples that a later `sample` will be given (e.g. decoding videos in the
        background); results never depend on it."""

    def rollout_counts(self) -> dict[str, list[int]]:
        """{name: per-prompt counts} of the prompts sampled since the last call (logged as rollout/NAME_mean, _max)."""
        return {}

    def close(self) -> None:
        """Release background workers at the end of a run."""

    def context_parallel(self, mesh, kind: str) -> None:
        raise ConfigError(f"{type(self).__name__} has no context parallelism: set train.context_parallel=1")

    def replace_outputs(self, rollout: Rollout, rows: torch.Tensor, outputs: list) -> Rollout:
        raise NotImplementedError(f"{type(self).__name__} cannot replace its outputs (algo.offpolicy=ground_truth needs "
                                  f"a token policy): set algo.offpolicy=none")


ADAPTER_FILE = "adapter_model.safetensors"


def reference_kind(cfg) -> str:
    """The reference a run needs: model.reference when algo.kl_coef > 0 or the policy loss compares with a reference
    (DGPO), else none (no frozen copy is kept)."""
    from mmrl.algorithms.objective import build_objective

    return cfg.model.reference if build_objective(cfg.algo).needs_reference else "none"


def upcast_trainable(module: torch.nn.Module) -> None:
    """fp32 master weights: trained parameters stored in bf16 / fp16 are cast to fp32 (the optimizer then updates
    fp32 weights, as Flow-GRPO's cast_training_params does for LoRA); frozen weights keep their dtype. On a module
    built on the meta device (FSDP's sharded loading) only the dtype changes: the fp32 storage is then allocated
    shard by shard (mmrl.models.pipelines.load_into_shards), never whole."""
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def write_policy_meta(path: str, policy: str, base_model: str, lora: bool, **model_options) -> None:
    """mmrl_policy.json: which policy wrote the checkpoint folder, its base model, whether it is an adapter,
    and the options the base model was loaded with (e.g. a generator's sample_size)."""
    import json

    os.makedirs(path, exist_ok=True)
    base = os.path.abspath(base_model)
    with open(os.path.join(path, "mmrl_policy.json"), "w") as f:
        json.dump({"policy": policy, "base_model": base, "lora": lora,
                   "base_model_relative": os.path.relpath(base, os.path.abspath(path)),
                   "model_options": model_options}, f, indent=2)


def base_model_path(meta: dict, policy_dir: str) -> str:
    """The base model folder an mmrl_policy.json names: its absolute path where it exists, else the same folder
    relative to the policy folder (a project moved or copied whole, a teammate's clone); else an error naming
    both places."""
    base = meta["base_model"]
    if os.path.exists(base):
        return base
    rel = meta.get("base_model_relative")
    if rel and os.path.exists(os.path.join(policy_dir, rel)):
        return os.path.normpath(os.path.join(policy_dir, rel))
    where = f" nor at {os.path.normpath(os.path.join(policy_dir, rel))!r} (relative to the checkpoint)" if rel else ""
    raise MissingFile(f"{policy_dir}: its base model is neither at {base!r}{where}. Put the base model "
                      f"back there, or edit base_model in {os.path.join(policy_dir, 'mmrl_policy.json')}")


PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module names


def save_lora_adapter(module: torch.nn.Module, lora_config, path: str) -> dict[str, torch.Tensor]:
    """The peft adapter of `module` as `PeftModel.from_pretrained` reads it: adapter_model.safetensors (keys under
    base_model.model.) + adapter_config.json. Returns the adapter's state dict (module names, no prefix)."""
    import os

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    sd = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(module).items()}
    prefix = "" if isinstance(module, PeftModel) else PEFT_PREFIX  # a PeftModel's names carry it already
    save_file({prefix + k: v.cpu() for k, v in sd.items()}, os.path.join(path, ADAPTER_FILE))
    lora_config.save_pretrained(path)
    return {k.removeprefix(PEFT_PREFIX): v for k, v in sd.items()}


def load_lora_adapter(module: torch.nn.Module, path: str) -> None:
    """Load adapter_model.safetensors (written by save_lora_adapter) into the adapter injected in `module`."""
    import os

    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, ADAPTER_FILE))
    if not isinstance(module, PeftModel):
        sd = {k.removeprefix(PEFT_PREFIX): v for k, v in sd.items()}
    result = set_peft_model_state_dict(module, sd)
    missing = [k for k in getattr(result, "unexpected_keys", [])]
    if missing:
        raise ConfigError(f"{path}: adapter weights {missing[:3]} ... match no LoRA layer of the model; was it "
                          f"trained on another base model or with other model.lora.target_modules?")


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face id (org/name) rather than a local path."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def resolve_model_path(path: str) -> str:
    """A model folder for model.path: the folder itself, or for a Hugging Face id (org/name) its snapshot in the
    local cache (HF_HOME); FileNotFoundError naming both ways to provide it otherwise."""
    if os.path.isdir(path):
        return path
    if is_hub_id(path):
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(path, local_files_only=True)
        except Exception:  # not cached (LocalEntryNotFoundError), or not a valid id
            pass
        raise MissingFile(f"model.path={path!r} is not a local folder and not in the Hugging Face cache; mmrl "
                          f"does not download during a run. Download it once (huggingface-cli download {path} "
                          f"--local-dir DIR) and set model.path=DIR, or fill the cache (HF_HOME) on a machine "
                          f"with network")
    raise MissingFile(f"model.path={path!r} does not exist (relative paths are relative to the working "
                      f"directory {os.getcwd()})")
