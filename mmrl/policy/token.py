"""Token policy: VLMs and video LLMs (transformers AutoModelForImageTextToText: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
and text-only causal LMs (AutoModelForCausalLM). Actions are completion tokens.

An example is a dict with "prompt" (the user text) and optionally "video" (a file path) or "image" (path or
PIL image); the chat template puts the media before the text. Each prompt is processed once (video decoded
by qwen-vl-utils with its frame metadata, `mmrl/video.py`) and cached; the same tensors feed generation and
every log-prob pass, so recomputed log-probs see exactly the sampled inputs.

Sequence layout for scoring: [left-padded prompt | completion (right-padded after EOS)], the layout HF
generation produces. With shared_prefix (default) each distinct prompt runs once per scoring pass and its KV
cache is indexed out to the G completions of its group: the same logits and gradients as the naive forward,
without paying G times for a long video prompt. Causal LMs get position ids counted over real tokens (as
`generate` does); Qwen-VL models get their M-RoPE positions from the model's own get_rope_index. Log-probs are
taken at the sampling temperature (logits / T) with a selective log-softmax that never materializes a second
[n, C, V] tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import torch
from mmrl.data import PolicyOutput, Rollout
from mmrl.errors import ConfigError, MissingFile
from mmrl.policy.token_kv import OneCall, SharedPrefixScoring
from mmrl.policy.base import (PolicyDefaults, base_model_path, load_lora_adapter, reference_kind, resolve_model_path,
                              save_lora_adapter, upcast_trainable, write_policy_meta)
from mmrl.rollout.engine import ENGINES, PrefixCacheEngine, SamplingParams, completion_mask
from mmrl.cache import BoundedCache
from mmrl.config import SHARDED, sample_chunk
from mmrl.video import VideoCache, VideoError, VideoOptions

log = logging.getLogger(__name__)
# LoRA on the language model only: attention and MLP projections, never the vision tower.
DEFAULT_LORA_TARGETS = r"^(?!.*(visual|vision)).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(ids) [n, C], entropy [n, C] without grad) from logits [n, C, V], one row at a time."""
    logps, ents = [], []
    for row_logits, row_ids in zip(logits, ids):
        lse = torch.logsumexp(row_logits, -1)                                          # [C]
        logps.append(row_logits.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1) - lse)
        with torch.no_grad():
            p = torch.softmax(row_logits.float(), -1)
            ents.append(lse.float() - torch.where(p > 0, p * row_logits.float(), 0.0).sum(-1))
    return torch.stack(logps), torch.stack(ents)


class TokenPolicy(SharedPrefixScoring, PolicyDefaults):
    def __init__(self, *, model, processor, sampler_cfg, lora_cfg, video: VideoOptions | None = None,
                 freeze_vision: bool = True, reference: str = "auto", model_path: str = "",
                 video_on_error: str = "raise", cache_size: int = 512, shared_prefix: bool = True,
                 micro_batch: int = 0, cache_mb: float = 2048, prefetch_workers: int = 0):
        self.shared_prefix = shared_prefix
        self.micro_batch = micro_batch  # sequences per forward in generation and old log-probs; 0 = all
        self.model, self.processor, self.cfg, self.model_path = model, processor, sampler_cfg, model_path
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.is_vlm = self.tokenizer is not processor
        # frames sized as qwen-vl-utils sizes them for this model: sides multiples of 2 x its vision patch
        vp = getattr(processor, "video_processor", None)
        self.video_opts = dataclasses.replace(video or VideoOptions(),
                                              **({"image_patch_size": vp.patch_size} if vp is not None else {}))
        self.video_on_error = video_on_error
        # decoded videos and processed prompts (their patches): bounded by count and by bytes each; videos decode in
        # prefetch_workers background threads when the trainer announces a batch ahead (`prefetch`)
        self.videos = VideoCache(cache_size, cache_mb * 2**20, prefetch_workers)
        self._merge = getattr(vp, "merge_size", 2)  # vision patches merged per token side
        self.video_tokens: list[int] = []  # vision tokens of each video prompt sampled since `rollout_counts`
        self._prompts = BoundedCache(cache_size, cache_mb * 2**20)
        self.skipped_examples = 0
        # True: rollouts carry NaN old log-probs and the trainer takes them from its first forward (exact
        # when that forward runs before any optimizer step); saves one forward pass per rollout.
        self.defer_old_log_prob = False
        self.pad_forwards = None  # FSDP: n -> extra forwards that keep every rank's forward count equal
        self.lockstep = False  # FSDP: every scoring call makes the same model calls (shared prefix: always two)
        self._ddp_score = None  # DDP: `score` as one DDP module call (parallelize)
        self._checkpointed: list[torch.nn.Module] = []  # gradient-checkpointed layers (enable_gradient_checkpointing)
        self.eos_id, self.pad_id = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_id
        self.lora = bool(lora_cfg.enabled)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            targets = list(lora_cfg.target_modules) or DEFAULT_LORA_TARGETS
            self.lora_config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, target_modules=targets,
                                          lora_dropout=0.0)
            self.model = get_peft_model(self.model, self.lora_config)
        elif freeze_vision:
            for name, p in self.model.named_parameters():
                if "visual" in name or "vision" in name:
                    p.requires_grad_(False)
        upcast_trainable(self.model)
        self.has_reference = reference == "auto"
        if self.has_reference and not self.lora:
            import copy

            self._ref_copy = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.device = next(self.model.parameters()).device
        self.model.train()
        # media placeholders (<|video_pad|> ...) and padding must never be sampled: a generated placeholder
        # breaks the next forward. They are suppressed in generation AND in the log-probs, so both see one
        # distribution.
        specials = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
        vocab = self.tokenizer.get_vocab()
        self.suppress_ids = sorted({vocab[t] for t in specials if t in vocab} | ({self.pad_id} - {self.eos_id}))
        self.engine = ENGINES[sampler_cfg.engine](self, sampler_cfg.vllm)  # who generates (mmrl/rollout/engine.py)

    # ------------------------------------------------------------------------------------------ prompts
    def _messages(self, ex: dict) -> list[dict]:
        if "messages" in ex:
            return ex["messages"]
        if not self.is_vlm:
            return [{"role": "user", "content": ex["prompt"]}]
        media = [{"type": "video"}] if ex.get("video") else [{"type": "image"}] if ex.get("image") else []
        text = [{"type": "text", "text": ex["prompt"]}]
        return [{"role": "user", "content": text + media if ex.get("text_first") else media + text}]

    def encode_prompt(self, ex: dict) -> dict[str, torch.Tensor]:
        """The processor's tensors for one prompt (input_ids [1, P], attention_mask [1, P], and for media e.g.
        pixel_values_videos [patches, D], video_grid_thw [1, 3]); cached by (prompt, media)."""
        key = (json.dumps(ex.get("messages"), sort_keys=True, default=str), ex.get("prompt"), ex.get("video"),
               str(ex.get("image")), bool(ex.get("text_first")), ex.get("shuffle_frames"))
        return self._prompts.get(key, lambda: self._process(ex))

    def _process(self, ex: dict) -> dict[str, torch.Tensor]:
        # processor is the tokenizer itself for causal LMs
        text = self.processor.apply_chat_template(self._messages(ex), tokenize=False, add_generation_prompt=True)
        if not self.is_vlm:
            return dict(self.tokenizer([text], return_tensors="pt", add_special_tokens=False))
        media = self._media(ex)
        if "video" in media:
            (frames, meta), = media["video"]
            # qwen-vl-utils sized the frames; the processor's resize applies the reference per-frame cap
            # (cap_pixels_per_frame), so a video costs the tokens it costs there
            return dict(self.processor(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                                       cap_pixels_per_frame=True, return_tensors="pt"))
        return dict(self.processor(text=[text], images=media.get("image"), return_tensors="pt"))

    def _media(self, ex: dict) -> dict:
        """The decoded media of one example as the processor takes them: {"video": [(frames [T, C, H, W] 0..255,
        metadata)]} (in the example's shuffled order, if any), {"image": [PIL image]}, or {} for text."""
        if ex.get("video"):
            frames, meta = self.videos.get(ex["video"], self.video_opts)
            if ex.get("shuffle_frames") is not None:  # contrast rollouts (T-GRPO): a fixed permutation per seed
                gen = torch.Generator().manual_seed(int(ex["shuffle_frames"]))
                frames = frames[torch.randperm(len(frames), generator=gen)]      # [T, C, H, W] in shuffled order
            return {"video": [(frames, meta)]}
        if ex.get("image") is not None:
            from PIL import Image

            img = ex["image"] if not isinstance(ex["image"], str) else Image.open(ex["image"]).convert("RGB")
            return {"image": [img]}
        return {}

    def engine_prompt(self, ex: dict) -> dict:
        """One prompt for an engine that runs the model's processor itself (vLLM): "prompt_ids", the chat text's ids
        with each image / video as its one un-expanded placeholder token, and "media", the decoded media the
        policy's processor saw (`_media`). The engine's expansion must give encode_prompt's input_ids."""
        text = self.processor.apply_chat_template(self._messages(ex), tokenize=False, add_generation_prompt=True)
        return {"prompt_ids": self.tokenizer(text, add_special_tokens=False).input_ids, "media": self._media(ex)}

    def _engine_prompts(self, examples: list[dict]) -> list[dict] | None:
        """engine_prompt of each example when the engine takes media (a VLM on vLLM), else None."""
        if not (self.is_vlm and getattr(self.engine, "takes_media", False)):
            return None
        return [self.engine_prompt(ex) for ex in examples]

    def _collate(self, prompts: list[dict], completions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Left-pad prompts and append completions [n, C] (pads after EOS get attention 0); media concatenated."""
        width = max(p["input_ids"].shape[1] for p in prompts)
        out: dict[str, list] = {}
        for p in prompts:
            pad = width - p["input_ids"].shape[1]
            for k, v in p.items():
                if k in ("input_ids", "attention_mask", "mm_token_type_ids"):
                    fill = self.pad_id if k == "input_ids" else 0
                    v = torch.cat([torch.full((1, pad), fill, dtype=v.dtype), v], 1)
                out.setdefault(k, []).append(v)
        batch = {k: torch.cat(v, 0) for k, v in out.items()}
        if completions is not None:
            cmask = completion_mask(completions, self.eos_id).long()
            batch["input_ids"] = torch.cat([batch["input_ids"], completions], 1)
            batch["attention_mask"] = torch.cat([batch["attention_mask"], cmask], 1)
            if "mm_token_type_ids" in batch:
                batch["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completions)], 1)
        if not self.is_vlm:
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return {k: v.to(self.device) for k, v in batch.items()}

    # ----------------------------------------------------------------------------------------- sampling
    def _usable(self, examples: list[dict]) -> list[dict]:
        """Examples whose media load; a broken video raises (video_on_error=raise) or is counted and skipped."""
        ok = []
        for ex in examples:
            try:
                self.encode_prompt(ex)
                ok.append(ex)
            except VideoError:
                if self.video_on_error == "raise":
                    raise
                self.skipped_examples += 1
                log.warning("skipped an example whose video cannot be read (%d so far)", self.skipped_examples,
                            exc_info=True)
        if not ok:
            raise RuntimeError("no example of this batch has a readable video; see the warnings above")
        return ok

    def prefetch(self, examples: list[dict]) -> None:
        """Start decoding the videos of `examples` in the background (video.prefetch_workers threads)."""
        self.videos.prefetch([ex["video"] for ex in examples if isinstance(ex.get("video"), str)], self.video_opts)

    def rollout_counts(self) -> dict[str, list[int]]:
        """Per-prompt counts since the last call, for the rollout logs: video_tokens (vision tokens of each sampled
        video prompt; VLMs only)."""
        counts, self.video_tokens = self.video_tokens, []
        return {"video_tokens": counts} if self.is_vlm else {}

    def close(self) -> None:
        self.videos.close()

    samples_rows = True  # sample(rows=...) gives whole groups of a batch, the same on any rank

    @torch.no_grad()
    def sample(self, examples: list[dict], group_size: int, generator: torch.Generator,
               rows: torch.Tensor | None = None) -> Rollout:
        """G completions per example; rows [n]: only these whole groups of the B * G rows (several processes).
        Group b samples from its own seed, seed + b G (vLLM seeds a request's G children seed, seed + 1, ...), so a
        group is the same whichever rank samples it; the rollout's group ids are the groups' indices in `examples`."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        groups = list(range(len(examples))) if rows is None else (rows[::group_size] // group_size).tolist()
        usable = {id(ex) for ex in self._usable([examples[g] for g in groups])}
        groups = [g for g in groups if id(examples[g]) in usable]
        params = SamplingParams(self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p, group_size)
        prompts = [self.encode_prompt(examples[g]) for g in groups]
        self.video_tokens += [int(p["video_grid_thw"].prod(-1).sum()) // self._merge ** 2 for p in prompts
                              if "video_grid_thw" in p]
        completions, engine_lp = self._generate(prompts, params, seed, [seed + g * group_size for g in groups],
                                                self._engine_prompts([examples[g] for g in groups]))  # [N, C]
        gid = torch.tensor(groups, dtype=torch.long).repeat_interleave(group_size)
        return self._rollout([examples[g] for g in groups for _ in range(group_size)], completions, gid,
                             engine_lp=engine_lp)

    def _rollout(self, rows: list[dict], completions: torch.Tensor, gid: torch.Tensor,
                 is_offpolicy: torch.Tensor | None = None, engine_lp: torch.Tensor | None = None) -> Rollout:
        """engine_lp [N, C]: the engine's log-prob of each sampled token (NaN where none), kept as
        extras["rollout_log_prob"] for algo.objective.tis_cap and the rollout/engine_ratio_dev statistic."""
        mask = completion_mask(completions, self.eos_id)
        extras = {"completion_ids": completions}
        if engine_lp is not None:
            extras["rollout_log_prob"] = engine_lp
        ro = Rollout(group_id=gid, old_log_prob=torch.zeros(completions.shape, dtype=torch.float32),
                     action_mask=mask, examples=rows, outputs=self.decode(completions),
                     extras=extras, is_offpolicy=is_offpolicy)
        if self.defer_old_log_prob:  # the trainer's first forward, under these same weights, fills them
            ro.old_log_prob.fill_(float("nan"))
        else:
            ro.old_log_prob = self.old_log_prob(ro, torch.arange(len(ro)))
        return ro

    def _generate(self, prompts: list[dict], params: SamplingParams, seed: int, group_seeds: list[int] | None = None,
                  engine_prompts: list[dict] | None = None):
        """Completions [len(prompts) * G, C] (CPU), generated for micro_batch // G prompts at a time (all at once
        when micro_batch is 0); chunk c samples with seed + c, and chunks are right-padded to one width. With them
        the engine's log-probs of the sampled tokens [len(prompts) * G, C] (NaN-padded), or None when the engine
        keeps none. engine_prompts: `_engine_prompts` of the same prompts, passed on to an engine that takes media."""
        per = max(1, self.micro_batch // params.group_size) if self.micro_batch else len(prompts)
        parts, lps = [], []
        for i in range(0, len(prompts), per):
            gs = group_seeds[i:i + per] if group_seeds is not None else None
            kw = {"prompts": engine_prompts[i:i + per]} if engine_prompts is not None else {}
            parts.append(self.engine.generate(self._collate(prompts[i:i + per]), params, seed + i // per, gs,
                                              **kw).cpu())
            lps.append(getattr(self.engine, "last_logprobs", None))
        width = max(p.shape[1] for p in parts)
        ids = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=self.pad_id) for p in parts])
        if any(lp is None for lp in lps):
            return ids, None
        lps = [torch.nn.functional.pad(lp[:, :width].float(), (0, width - min(lp.shape[1], width)), value=float("nan"))
               for lp in lps]
        return ids, torch.cat(lps)

    def decode(self, completions: torch.Tensor) -> list[str]:
        """Completion texts without the EOS and padding, special tokens (e.g. <answer>) kept."""
        mask = completion_mask(completions, self.eos_id) & (completions != self.eos_id) & (completions != self.pad_id)
        return [self.tokenizer.decode(row[m].tolist(), skip_special_tokens=False) for row, m in zip(completions, mask)]

    @torch.no_grad()
    def old_log_prob(self, rollout: Rollout, index: torch.Tensor) -> torch.Tensor:
        """Log-probs [n, C] (CPU, no grad) of rows `index`, micro_batch rows per forward (32 when unset)."""
        chunk = self.micro_batch or 32
        out = torch.cat([self.log_prob(rollout, index[i:i + chunk]).log_prob.cpu()
                         for i in range(0, len(index), chunk)])
        if self.pad_forwards is not None:  # FSDP: as many forwards as the rank with the most chunks
            for _ in range(self.pad_forwards(-(-len(index) // chunk))):
                self.log_prob(rollout, index[:1])
        return out

    # ------------------------------------------------------------------------------------------ scoring
    def log_prob(self, rollout: Rollout, index: torch.Tensor) -> PolicyOutput:
        """Log-probs [n, C] of the completion tokens of rows `index` (one scoring call: `score`)."""
        cpu_ids = rollout.extras["completion_ids"][index]                                   # [n, C]
        ids = cpu_ids.to(self.device)
        prompts = [self.encode_prompt(rollout.examples[i]) for i in index.tolist()]
        distinct = list({id(p): p for p in prompts}.values())                              # U prompts
        # several processes: every scoring call takes the shared-prefix path, so every rank makes the same model calls
        if self.shared_prefix and (self.lockstep or len(distinct) < len(prompts)):
            order = {id(p): u for u, p in enumerate(distinct)}
            rows = torch.tensor([order[id(p)] for p in prompts], device=self.device)       # [n] -> its prompt
            args = (self._collate(distinct), ids, rows)
        else:
            args = (self._collate(prompts, cpu_ids), ids)
        # DDP: a pass with gradients is one call of the DDP module, however many model calls it makes
        score = self._ddp_score if self._ddp_score is not None and torch.is_grad_enabled() else self.score
        logits = score(*args)
        temperature = self.cfg.temperature if self.cfg.temperature > 0 else 1.0
        logits = logits.float() / temperature
        if self.suppress_ids:
            logits[..., self.suppress_ids] = float("-inf")
        logp, ent = selective_log_softmax(logits, ids)
        # padding after EOS (or after a truncated row, once injection widened the batch): 0, never -inf
        real = (completion_mask(ids, self.eos_id) & rollout.action_mask[index].to(self.device))
        return PolicyOutput(logp.masked_fill(~real, 0.0), {"entropy": ent.masked_fill(~real, 0.0)})

    def replace_outputs(self, rollout: Rollout, rows: torch.Tensor, texts: list[str]) -> Rollout:
        """Rollout whose rows `rows` [k] hold `texts` (+ EOS) as completions, marked off-policy, their old
        log-probs recomputed under the current weights (TempSamp-R1 ground-truth injection)."""
        new = [self.tokenizer(t, add_special_tokens=False).input_ids + [self.eos_id] for t in texts]
        old = rollout.extras["completion_ids"]
        c = max(old.shape[1], max(len(x) for x in new))
        ids = torch.full((len(rollout), c), self.pad_id, dtype=old.dtype)
        ids[:, :old.shape[1]] = old
        for r, x in zip(rows.tolist(), new):
            ids[r] = self.pad_id
            ids[r, :len(x)] = torch.tensor(x)
        off = rollout.is_offpolicy.clone()
        off[rows] = True
        # a sampled row that hit max_new_tokens without EOS gains pad columns: they are not actions
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[:, :old.shape[1]] = rollout.action_mask
        mask[rows] = completion_mask(ids[rows], self.eos_id)
        extras = {"completion_ids": ids}
        if "rollout_log_prob" in rollout.extras:  # the injected rows were not sampled by the engine: NaN (weight 1)
            lp = torch.full(ids.shape, float("nan"))
            lp[:, :old.shape[1]] = rollout.extras["rollout_log_prob"]
            lp[rows] = float("nan")
            extras["rollout_log_prob"] = lp
        ro = Rollout(group_id=rollout.group_id, old_log_prob=torch.zeros(ids.shape), action_mask=mask,
                     examples=rollout.examples, outputs=self.decode(ids), extras=extras, is_offpolicy=off)
        ro.old_log_prob[:, :old.shape[1]] = rollout.old_log_prob
        ro.old_log_prob[rows] = self.old_log_prob(ro, rows)
        return ro

    @contextlib.contextmanager
    def reference(self):
        if not self.has_reference:
            raise RuntimeError("no reference model: set model.reference=auto to use a KL penalty")
        if self.lora:
            with self.model.disable_adapter():
                yield
        else:
            live = self.model
            self.model = self._ref_copy
            try:
                yield
            finally:
                self.model = live

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def sync_weights(self) -> None:
        """After the optimizer steps of an iteration: the rollout engine picks up the new weights."""
        self.engine.sync_weights()

    # ------------------------------------------------------------------------------- several processes
    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def parallelize(self, wrap, parallel: str) -> None:
        """DDP: the scoring pass with gradients is one forward of a DDP module around `score` (its prompt and completion
        model calls are one DDP forward, which DDP's reducer needs: it marks each parameter ready once per backward);
        the model itself stays unwrapped (generation, no-grad scoring). FSDP2: the model is sharded in place, and
        since every forward all-gathers parameters on all ranks, every rank must run the same forwards: decoding runs
        until all ranks are done (prefix-cache engine only), old log-probs pad to the most chunks, and with
        shared-prefix scoring every scoring call takes the two-forward path (`lockstep`), whatever its rows."""
        if parallel in SHARDED:
            if not isinstance(self.engine, PrefixCacheEngine):
                raise ConfigError(f"train.parallel={parallel} needs sampler.engine=prefix_cache for token policies")
            # on the trainer's Distributed (set before parallelize): its CPU group, as NCCL has no CPU backend
            self.engine.all_done = self.dist.all_true
            self.pad_forwards = lambda n: self.dist.max_int(n) - n
            self.lockstep = True
            self.model = wrap(self.model)
        else:
            self._ddp_score = wrap(OneCall(self.model, self.score))

    @torch.no_grad()
    def evaluate(self, examples: list[dict], seed: int) -> list[str]:
        """Greedy completions (the benchmark protocol); examples whose video is unreadable score as ''."""
        usable = self._usable(examples) if self.video_on_error == "skip" else examples
        keep = {id(ex) for ex in usable}
        params = SamplingParams(self.cfg.max_new_tokens, 0.0, 1.0, 1)
        texts = iter(self.decode(self._generate([self.encode_prompt(ex) for ex in usable], params, seed, None,
                                                self._engine_prompts(usable))[0]))
        return [next(texts) if id(ex) in keep else "" for ex in examples]

    # ---------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, path: str) -> None:
        """LoRA: the peft adapter folder. Full fine-tuning: model + processor (loadable with from_pretrained)."""
        write_policy_meta(path, "token", self.model_path, self.lora)
        if self.lora:
            save_lora_adapter(self.model, self.lora_config, path)
        else:
            self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    def load_trainable_state(self, path: str) -> None:
        if self.lora:
            load_lora_adapter(self.model, path)
        else:
            self.model.load_state_dict(type(self.model).from_pretrained(path).state_dict())


VLM_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def is_vlm_folder(path: str) -> bool:
    """Whether a transformers folder holds a VLM (an image / video processor config beside the model), read from the
    file names alone: what `mmrl validate` and the loader decide alike, before any weight loads."""
    return any(os.path.isfile(os.path.join(path, f)) for f in VLM_FILES)


def load_token_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     trust_remote_code: bool = False):
    """(model, processor) of a transformers folder: a VLM when the folder has an image/video processor config,
    else a causal LM with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    if not os.path.isdir(path):
        raise MissingFile(f"model.path={path!r} is not a folder; point it at a transformers model folder "
                          f"(e.g. Qwen2.5-VL-3B-Instruct, or scripts/sft_grounding.py's output)")
    kw = dict(trust_remote_code=trust_remote_code)
    if is_vlm_folder(path):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **kw)
        processor = AutoProcessor.from_pretrained(path, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
        processor = AutoTokenizer.from_pretrained(path, **kw)
    return model.to(device), processor


def build_token_policy(cfg) -> TokenPolicy:
    from mmrl.devices import resolve_device, torch_dtype

    dtype, device = torch_dtype(cfg.model.dtype), resolve_device(cfg.model.device)
    path = resolve_model_path(cfg.model.path)
    if os.path.isfile(os.path.join(path, "mmrl_policy.json")):
        meta = json.load(open(os.path.join(path, "mmrl_policy.json")))
        if meta.get("lora"):
            raise ConfigError(f"{path!r} is a LoRA policy checkpoint; set model.path to its base model "
                              f"({meta.get('base_model')}) and use mmrl eval for the checkpoint")
    model, processor = load_token_model(path, dtype, device, cfg.model.trust_remote_code)
    v = cfg.video
    opts = VideoOptions(v.backend, v.fps, v.nframes, v.min_pixels, v.max_pixels, v.total_pixels)
    return TokenPolicy(model=model, processor=processor, sampler_cfg=cfg.sampler, lora_cfg=cfg.model.lora, video=opts,
                       freeze_vision=cfg.model.freeze_vision, reference=reference_kind(cfg), model_path=path,
                       video_on_error=v.on_error, cache_size=v.cache_size, shared_prefix=cfg.model.shared_prefix,
                       micro_batch=sample_chunk(cfg.train), cache_mb=v.cache_mb, prefetch_workers=v.prefetch_workers)



def load_token_policy(path: str, video: VideoOptions | None = None, video_on_error: str = "raise",
                      max_new_tokens: int = 64) -> TokenPolicy:
    """A TokenPolicy for evaluation from a model folder or an mmrl vlm checkpoint (full, or base + LoRA adapter)."""
    from mmrl.config import LoraConfig, SamplerConfig

    meta_file = os.path.join(path, "mmrl_policy.json")
    meta = json.load(open(meta_file)) if os.path.isfile(meta_file) else {"lora": False}
    model, processor = load_token_model(base_model_path(meta, path) if meta["lora"] else path)
    if meta["lora"]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path)
    model.eval()
    return TokenPolicy(model=model, processor=processor,
                       sampler_cfg=SamplerConfig(temperature=0.0, max_new_tokens=max_new_tokens), lora_cfg=LoraConfig(),
                       video=video, freeze_vision=True, reference="none", model_path=path, video_on_error=video_on_error)
