"""Janus-Pro as a token policy whose actions are image tokens (transformers `JanusForConditionalGeneration`,
arXiv 2501.17811). `model.policy: janus`.

An action is one of the A image tokens (codebook indices; A = 576 for Janus-Pro's 384 px images) that Janus
generates after its prompt `<|User|>: {prompt}\\n\\n<|Assistant|>:<begin_of_image>` (the processor's chat template and
`generation_mode="image"`, as transformers documents it). The outputs are the VQ model's decoding of the A tokens,
images [N, 3, H, W] in [-1, 1]: the form FlowPolicy returns, so every image reward scores them unchanged.

Sampling is Janus's classifier-free guidance (transformers' `generate(generation_mode="image")`, T2I-R1's sampler):
each row runs twice, conditional (the prompt) and unconditional (the prompt with every token but BOS and
`<begin_of_image>` replaced by the pad token), and token k is drawn from
    p(. | x<k) = softmax((u + s (c - u)) / T),   c, u: the generation head's logits of the two rows [K],
with s = sampler.cfg_scale (training rollouts) or sampler.eval_cfg_scale (evaluation) and T = sampler.temperature.
Row r draws its A tokens from its own generator seeded seed + r (one multinomial per step): a row is the same in any
batch and on any rank, and it equals transformers' `generate` of its prompt alone after torch.manual_seed(seed + r)
(tests/test_janus.py: same tokens, same pixels). transformers' batched `generate` instead draws every row of a batch
from one global stream (and counts positions over left padding), so its rows depend on the batch they sit in;
positions here are counted over real tokens, as the token policy counts them.

Log-probs (a decision): the log-prob of a sampled token is taken under the distribution the sampler drew it from,
the CFG-combined logits at the sampling temperature, computed from a teacher-forced forward of the conditional and
unconditional rows. Then `exp(logp - logp_old)` is the importance ratio of the sampler itself, PPO's clip and the
KL estimators act on the policy that made the images, and the on-policy ratio is 1 (up to the rounding of a full
forward against the KV-cached sampling forward; tests: max |ratio - 1| < 1e-4). T2I-R1 (its grpo_trainer.py)
samples with CFG 5 but scores the conditional logits alone (no CFG, temperature 1), and SimpleAR's GRPO
(TRL's GRPOTrainer) scores the plain conditional forward too: half the training forward, but the stored "old"
log-prob is then not the probability of the sampler, so the ratio is not an importance weight of the rollouts (with
one optimizer step per rollout, as T2I-R1 runs, it is 1 by construction and nothing notices; with several it
clips the wrong quantity). sampler.cfg_grad picks the gradient (not the value): `full` differentiates both rows,
the exact gradient of log p above; `cond` (Flow-GRPO's choice for flow CFG) runs the unconditional row without
gradient, which saves its backward and moves the weights only through the conditional row (closer to T2I-R1).

Reused, not copied: `selective_log_softmax` (the token policy's), the objective, KL estimators (k1 / k2 / k3) and
micro-batching of the trainer (whole rows per training forward: train.micro_batch; sampling, decoding and old
log-probs in chunks of train.sample_chunk rows). Shared-prefix scoring does not apply: the prompt (~30 tokens) is
short beside the 576 image tokens that every row scores anyway. LoRA (peft) targets the language model's
attention and MLP projections; full fine-tuning trains the language model and the generation embeddings, aligner
and head. The understanding path (SigLIP encoder, aligner, text head) and the VQ model stay frozen.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from mmrl.cache import BoundedCache
from mmrl.config import SHARDED
from mmrl.data import PolicyOutput, Rollout, group_ids
from mmrl.errors import ConfigError, MissingFile
from mmrl.models.shard_load import (copy_shards, init_adapters, load_into_shards, shardable_weights, sharded_start,
                                    to_load_dtype)
from mmrl.policy.base import (PolicyDefaults, load_lora_adapter, reference_kind, resolve_model_path,
                              save_lora_adapter, upcast_trainable, write_policy_meta)
from mmrl.policy.token import DEFAULT_LORA_TARGETS, selective_log_softmax
from mmrl.seeds import derive_seed

SCORE_CHUNK = 8  # rows per old-log-prob forward when train.sample_chunk is 0 (logits [2 x 8, 576, 16384] fp32 = 0.6 GB)


class ImageTokenLM(torch.nn.Module):
    """The trained path of Janus's image generation as one module (what DDP / FSDP wrap, what checkpoints name):
    prompt tokens through the text embeddings, image tokens through the generation embeddings and aligner, the
    language model, then the generation head over the codebook. The vision encoder and the VQ model are not in it."""

    def __init__(self, janus: torch.nn.Module):
        super().__init__()
        m = janus.model
        self.language_model = m.language_model
        self.generation_embeddings, self.generation_aligner = m.generation_embeddings, m.generation_aligner
        self.generation_head = m.generation_head

    def forward(self, prompt_ids: torch.Tensor | None, image_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache=None, keep: int = 0):
        """Logits [b, keep, K] (keep=0: every position) of the next image token after each of the last `keep`
        positions of [prompt_ids [b, P] | image_ids [b, I]] (either may be None when the cache holds what precedes),
        and the KV cache (None without `cache`). attention_mask [b, past + P + I]; position_ids [b, P + I]."""
        parts = []
        if prompt_ids is not None:
            parts.append(self.language_model.get_input_embeddings()(prompt_ids))            # [b, P, D]
        if image_ids is not None:
            parts.append(self.generation_aligner(self.generation_embeddings(image_ids)))    # [b, I, D]
        out = self.language_model(inputs_embeds=torch.cat(parts, 1), attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=cache, use_cache=cache is not None)
        h = out.last_hidden_state
        return self.generation_head(h[:, -keep:] if keep else h), out.past_key_values


def positions(mask: torch.Tensor) -> torch.Tensor:
    """[b, L] position ids counted over real tokens (left padding gets 0), as the token policy counts them."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


class JanusPolicy(PolicyDefaults):
    samples_rows = True  # row r samples from seed + r: any subset of a batch's rows, the same on any rank

    def __init__(self, *, model, processor, sampler_cfg, lora_cfg, reference: str = "auto", model_path: str = "",
                 micro_batch: int = 0, device: torch.device | None = None, seed: int = 0):
        """device: given when `model`'s image-token path was built on the meta device (`load_janus(shard=True)`):
        `parallelize` then reads this rank's FSDP2 shards of it from model_path, and the reference copies them (or
        LoRA's adapters start there); seed: the run's (train.seed), from which LoRA's adapters start (`init_adapters`,
        the same whole or in shards)."""
        self.janus, self.processor, self.model_path, self.micro_batch = model, processor, model_path, micro_batch
        self.temperature, self.cfg_grad = sampler_cfg.temperature, sampler_cfg.cfg_grad
        self.cfg_scale, self.eval_cfg_scale = sampler_cfg.cfg_scale, sampler_cfg.eval_cfg_scale
        tok = processor.tokenizer
        self.bos_id, self.pad_id = tok.bos_token_id, tok.pad_token_id
        self.boi_id = tok.convert_tokens_to_ids(processor.image_start_token)
        self.num_tokens = model.config.vision_config.num_image_tokens                  # A
        self._prompts = BoundedCache(4096, 2**28)
        model.requires_grad_(False)
        self.lora = bool(lora_cfg.enabled)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            self.lora_config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=0.0,
                                          target_modules=list(lora_cfg.target_modules) or DEFAULT_LORA_TARGETS)
            self.model = get_peft_model(model, self.lora_config)  # adapters injected into `model` in place
        else:
            self.model = model
        self.lm = ImageTokenLM(model)
        self.has_reference = reference == "auto"
        # full fine-tuning's frozen KL reference: a copy in the checkpoint's dtype, made before the trained path is
        # upcast to fp32 master weights (on the meta device when the run loads into shards: parallelize fills it)
        self._ref = None
        if self.has_reference and not self.lora:
            import copy

            self._ref = copy.deepcopy(self.lm).requires_grad_(False).eval()
        if not self.lora:
            self.lm.requires_grad_(True)
        upcast_trainable(self.lm)
        self._pending, self.seed = device is not None, seed
        self.device = device if self._pending else next(self.lm.parameters()).device
        if self.lora and not self._pending:  # else parallelize starts them in their shards
            init_adapters(self.lm, self.lora_config.init_lora_weights, derive_seed(seed, "lora_init", 0))
        self.model.train()
        model.model.vqmodel.eval()

    # ------------------------------------------------------------------------------------------ prompts
    def encode_prompt(self, ex: dict) -> torch.Tensor:
        """input_ids [1, P] of an example's prompt in Janus's image-generation form (ends in <begin_of_image>)."""
        return self._prompts.get(ex["prompt"], lambda: self._encode(ex["prompt"]))

    def _encode(self, text: str) -> torch.Tensor:
        if not self.processor.chat_template:
            raise ConfigError(f"{self.model_path}: the Janus processor has no chat template; use a transformers "
                              f"Janus folder (e.g. deepseek-community/Janus-Pro-1B), whose processor has one")
        chat = self.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                                  add_generation_prompt=True)
        return self.processor(text=chat, generation_mode="image", return_tensors="pt")["input_ids"]

    def _collate(self, prompts: list[torch.Tensor], guided: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask [n, P]; guided: the n unconditional rows follow (ids [2n, P], mask
        [2n, P]): every token but BOS and <begin_of_image> replaced by the pad token, as Janus's generate does."""
        width = max(p.shape[1] for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
        if guided:
            uncond = ids.masked_fill((ids != self.bos_id) & (ids != self.boi_id), self.pad_id)
            ids, mask = torch.cat([ids, uncond]), torch.cat([mask, mask])
        return ids.to(self.device), mask.to(self.device)

    def _guide(self, logits: torch.Tensor, scale: float) -> torch.Tensor:
        """Sampling logits [n, ..., K] (fp32) from the model's [2n, ..., K] (cond rows, then uncond) or [n, ..., K]
        (scale 1): (u + s (c - u)) / T, in the order transformers' CFG and temperature processors compute it."""
        logits = logits.float()
        if scale != 1:
            c, u = logits.chunk(2)
            logits = u + (c - u) * scale
        return logits / self.temperature

    # ----------------------------------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(self, examples: list[dict], group_size: int, generator: torch.Generator,
               rows: torch.Tensor | None = None) -> Rollout:
        """G images per example; rows [n]: only these of the B * G rows (several processes). Row r samples from
        seed + r, seed drawn from `generator`."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        rows = torch.arange(len(examples) * group_size) if rows is None else rows
        row_examples = [examples[r // group_size] for r in rows.tolist()]
        ids, lps = self._sample_rows(row_examples, [seed + r for r in rows.tolist()], self.cfg_scale)   # [n, A]
        ro = Rollout(group_id=group_ids(len(examples), group_size)[rows],
                     old_log_prob=torch.full(ids.shape, float("nan")),
                     action_mask=torch.ones(ids.shape, dtype=torch.bool),
                     examples=row_examples, outputs=self.decode(ids),
                     extras={"image_ids": ids, "rollout_log_prob": lps})
        if not self.defer_old_log_prob:  # deferred: the trainer's first forward, under these weights, fills them
            ro.old_log_prob = self.old_log_prob(ro, torch.arange(len(ro)))
        return ro

    def _sample_rows(self, examples: list[dict], seeds: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Image tokens [n, A] (CPU) of one row per example, row i from seeds[i], and the sampler's log-prob of each
        [n, A]; micro_batch rows (2x with CFG) per forward."""
        chunk = self.micro_batch or len(examples)
        parts = [self._generate([self.encode_prompt(ex) for ex in examples[i:i + chunk]], seeds[i:i + chunk], scale)
                 for i in range(0, len(examples), chunk)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @torch.no_grad()
    def _generate(self, prompts: list[torch.Tensor], seeds: list[int], scale: float):
        """A tokens for each prompt: prefill, then one token per step against the KV cache (conditional and
        unconditional rows together), each row drawn by its own generator."""
        from transformers import DynamicCache

        guided = scale != 1
        ids, mask = self._collate(prompts, guided)                                         # [r, P], r = n or 2n
        gens = [torch.Generator(self.device).manual_seed(s) for s in seeds]
        was_training = self.lm.training
        self.lm.eval()  # gradient checkpointing (training mode) would drop the KV cache
        try:
            pos = positions(mask)
            logits, cache = self.lm(ids, None, mask, pos, DynamicCache(), keep=1)         # [r, 1, K]
            nxt = pos[:, -1]                                                                # [r]
            toks, lps = [], []
            for k in range(self.num_tokens):
                scores = self._guide(logits[:, -1], scale)                                  # [n, K]
                probs = torch.softmax(scores, -1)
                tok = torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, gens)])  # [n]
                toks.append(tok)
                lps.append(torch.log_softmax(scores, -1).gather(1, tok[:, None])[:, 0])
                if k == self.num_tokens - 1:
                    break
                step = tok.repeat(2 if guided else 1)[:, None]                              # [r, 1]
                mask = torch.cat([mask, torch.ones_like(step)], 1)
                logits, cache = self.lm(None, step, mask, (nxt + 1 + k)[:, None], cache, keep=1)
        finally:
            self.lm.train(was_training)
        return torch.stack(toks, 1).cpu(), torch.stack(lps, 1).float().cpu()

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Images [n, 3, H, W] in [-1, 1] (CPU, fp32) of image tokens [n, A]: Janus's VQ decoder, chunked."""
        vq = self.janus.model.vqmodel
        chunk = self.micro_batch or len(ids)
        return torch.cat([vq.decode(ids[i:i + chunk].to(self.device)).clamp(-1, 1).float().cpu()
                          for i in range(0, len(ids), chunk)])

    @torch.no_grad()
    def old_log_prob(self, rollout: Rollout, index: torch.Tensor) -> torch.Tensor:
        """Log-probs [n, A] (CPU, no grad) of rows `index`, micro_batch rows per forward (SCORE_CHUNK when unset)."""
        chunk = self.micro_batch or SCORE_CHUNK
        return torch.cat([self.log_prob(rollout, index[i:i + chunk]).log_prob.cpu()
                          for i in range(0, len(index), chunk)])

    @torch.no_grad()
    def evaluate(self, examples: list[dict], seed: int) -> torch.Tensor:
        """One image per example (example i from seed + i) at sampler.eval_cfg_scale: [n, 3, H, W] in [-1, 1]."""
        ids, _ = self._sample_rows(examples, [seed + i for i in range(len(examples))], self.eval_cfg_scale)
        return self.decode(ids)

    # ------------------------------------------------------------------------------------------ scoring
    def log_prob(self, rollout: Rollout, index: torch.Tensor) -> PolicyOutput:
        """Log-probs [n, A] (with grad) of the stored image tokens of rows `index` under the sampler's distribution
        (CFG-combined logits at the sampling temperature; module docstring), from one teacher-forced forward."""
        ids = rollout.extras["image_ids"][index].to(self.device)                           # [n, A]
        prompts = [self.encode_prompt(rollout.examples[i]) for i in index.tolist()]
        logp, ent = selective_log_softmax(self._scores(prompts, ids, self.cfg_scale), ids)
        return PolicyOutput(logp, {"entropy": ent})

    def _scores(self, prompts: list[torch.Tensor], ids: torch.Tensor, scale: float) -> torch.Tensor:
        """Sampling logits [n, A, K] of image tokens ids [n, A]: token k is predicted from the prompt and tokens < k."""
        guided, n, a = scale != 1, len(prompts), ids.shape[1]
        prompt, mask = self._collate(prompts, guided)                                      # [r, P]
        image = ids[:, :-1].repeat(2 if guided else 1, 1)                                  # [r, A - 1]
        mask = torch.cat([mask, torch.ones_like(image)], 1)                                # [r, P + A - 1]
        pos = positions(mask)
        if not guided or self.cfg_grad == "full":
            return self._guide(self.lm(prompt, image, mask, pos, keep=a)[0], scale)
        cond = self.lm(prompt[:n], image[:n], mask[:n], pos[:n], keep=a)[0]                # [n, A, K]
        with torch.no_grad():
            uncond = self.lm(prompt[n:], image[n:], mask[n:], pos[n:], keep=a)[0]
        return self._guide(torch.cat([cond, uncond]), scale)

    @contextlib.contextmanager
    def reference(self):
        if not self.has_reference:
            raise RuntimeError("no reference model: set model.reference=auto to use a KL penalty")
        if self.lora:
            with self.model.disable_adapter():
                yield
            return
        live, self.lm = self.lm, self._ref
        try:
            yield
        finally:
            self.lm = live

    def trainable_parameters(self):
        return [p for p in self.lm.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------- several processes
    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.lm]

    def parallelize(self, wrap, parallel: str) -> None:
        """DDP wraps the image-token path (gradients all-reduced in backward); FSDP2 shards it in place, and the frozen
        KL reference of full fine-tuning too (else a whole replica on every GPU). Sampling, scoring and the reference
        all go through them, so every rank runs the same forwards (A steps per chunk, and Distributed.sample gives
        every rank as many rows under FSDP). Built on the meta device: each rank then reads only its shards."""
        self.lm = wrap(self.lm)
        if parallel in SHARDED and self._ref is not None:
            self._ref = wrap(self._ref)
        if self._pending:
            if parallel not in SHARDED:
                raise RuntimeError(f"Janus's image-token path built on the meta device is loaded into FSDP shards; "
                                   f"train.parallel={parallel} has none")
            load_into_shards(self.lm, self.model_path, self.device, prefix="model.")
            if self.lora:
                init_adapters(self.lm, self.lora_config.init_lora_weights, derive_seed(self.seed, "lora_init", 0))
            if self._ref is not None:
                copy_shards(self.lm, self._ref, self.device)
            self._pending = False

    def enable_gradient_checkpointing(self) -> None:
        """The language model's layers recompute their activations in backward (sampling runs in eval mode, where
        transformers keeps the KV cache)."""
        lm = self.janus.model.language_model
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x's name (the old one warns)
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # ---------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, path: str) -> None:
        """LoRA: the peft adapter folder (PeftModel.from_pretrained(JanusForConditionalGeneration, path)). Full
        fine-tuning: the whole Janus folder (JanusForConditionalGeneration.from_pretrained). Both with the processor."""
        write_policy_meta(path, "janus", self.model_path, self.lora)
        if self.lora:
            save_lora_adapter(self.model, self.lora_config, path)
        else:
            self.janus.save_pretrained(path)
        self.processor.save_pretrained(path)

    def load_trainable_state(self, path: str) -> None:
        if self.lora:
            load_lora_adapter(self.model, path)
        else:
            from transformers import JanusForConditionalGeneration

            self.janus.load_state_dict(JanusForConditionalGeneration.from_pretrained(path).state_dict())


# ------------------------------------------------------------------------------------------------ building
def check_janus_config(cfg) -> None:
    """What model.policy=janus cannot honour, naming the fix (the keys it reads: its kind's declaration,
    mmrl/policy/kinds.py, checked at load)."""
    from mmrl.algorithms.objective import build_objective

    s = cfg.sampler
    if s.temperature <= 0:
        raise ConfigError(f"sampler.temperature={s.temperature}: Janus samples its image tokens (greedy decoding "
                          f"gives one image per prompt and no group variance); use 1.0 (Janus-Pro, T2I-R1)")
    if min(s.cfg_scale, s.eval_cfg_scale) < 1:
        raise ConfigError(f"sampler.cfg_scale / eval_cfg_scale must be >= 1 (1 = no guidance; Janus-Pro uses 5), got "
                          f"{s.cfg_scale} / {s.eval_cfg_scale}")
    if build_objective(cfg.algo).actions != "transitions":
        raise ConfigError("this policy loss trains on the forward process of flow samples; model.policy=janus has "
                          "image tokens: use algo.objective.name=ppo_clip (or dgpo / dpo)")


def load_janus(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", shard: bool = False):
    """(JanusForConditionalGeneration, JanusProcessor) of a transformers Janus folder. shard: the image-token path
    (`ImageTokenLM`: language model, generation embeddings, aligner and head) is built on the meta device in `dtype`
    for JanusPolicy.parallelize to read into FSDP2 shards; the frozen parts (vision encoder, aligner, VQ model) load
    whole. The text head (tied to the text embeddings; image generation never calls it) stays on the meta device."""
    from transformers import AutoProcessor, JanusForConditionalGeneration

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise MissingFile(f"model.path={path!r} has no config.json: point it at a transformers Janus folder "
                          f"(e.g. a download of deepseek-community/Janus-Pro-1B or -7B)")
    kind = json.load(open(config)).get("model_type")
    if kind != "janus":
        raise ConfigError(f"model.path={path!r} holds model_type={kind!r}, not 'janus'. model.policy=janus loads "
                          f"transformers' JanusForConditionalGeneration: use the converted "
                          f"deepseek-community/Janus-Pro-1B or -7B (deepseek-ai/Janus-Pro-* need the Janus "
                          f"repository's own code)")
    model = _meta_janus(path, dtype, device) if shard else \
        JanusForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device)
    vq, vision = model.config.vq_config, model.config.vision_config
    if vision.num_image_tokens != vq.num_patches ** 2:
        raise ConfigError(f"{config}: vision_config.num_image_tokens={vision.num_image_tokens} but the VQ decoder "
                          f"reads a {vq.num_patches} x {vq.num_patches} grid of tokens")
    return model, AutoProcessor.from_pretrained(path)


def _meta_janus(path: str, dtype: torch.dtype, device: str):
    """JanusForConditionalGeneration with every parameter on the meta device (in `dtype`; buffers real), then its
    frozen parts read whole onto `device` from the safetensors files."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, JanusForConditionalGeneration

    with init_empty_weights(include_buffers=False):
        model = to_load_dtype(JanusForConditionalGeneration(AutoConfig.from_pretrained(path)), dtype)
    m = model.model
    for name in ("vision_model", "aligner", "vqmodel"):
        load_into_shards(getattr(m, name), path, torch.device(device), prefix=f"model.{name}.")
    return model.eval()


def build_janus_policy(cfg, dist=None) -> JanusPolicy:
    from mmrl.config import sample_chunk
    from mmrl.devices import indexed, resolve_device, torch_dtype

    check_janus_config(cfg)
    dtype, device = torch_dtype(cfg.model.dtype), resolve_device(cfg.model.device)
    path = resolve_model_path(cfg.model.path)
    meta_file = os.path.join(path, "mmrl_policy.json")
    if os.path.isfile(meta_file) and json.load(open(meta_file)).get("lora"):
        raise ConfigError(f"{path!r} is a LoRA policy checkpoint; set model.path to its base model "
                          f"({json.load(open(meta_file)).get('base_model')}) and use mmrl eval for the checkpoint")
    shard = sharded_start(cfg, dist) and shardable_weights(path)  # every rank holds 1/world of it from the first byte
    model, processor = load_janus(path, dtype, indexed(device) if shard else device, shard=shard)
    return JanusPolicy(model=model, processor=processor, sampler_cfg=cfg.sampler, lora_cfg=cfg.model.lora,
                       reference=reference_kind(cfg), model_path=path, micro_batch=sample_chunk(cfg.train),
                       device=indexed(device) if shard else None, seed=cfg.train.seed)


build_janus_policy.check_config = check_janus_config  # mmrl validate runs it before any weight loads
