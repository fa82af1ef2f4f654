"""Rollout engines for token policies: who generates completions. HF `generate` (HFEngine) and a decoder
over the policy's shared-prefix KV cache (PrefixCacheEngine); vLLM plugs in behind the same interface
without the policy or the trainer changing.

An engine takes a left-padded prompt batch (the processor's tensors for B prompts) and returns completion
token ids [B * G, C] (rows grouped by prompt: prompt b owns rows b*G .. b*G + G - 1), padded with pad_id after
the first EOS. The policy recomputes every log-prob itself; an engine that samples from its own numbers may also
keep the log-prob of each token it sampled in `last_logprobs` [B * G, C] (NaN where none), which the policy puts in
the rollout for the truncated importance-sampling correction (algo.objective.tis_cap) and the mismatch statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mmrl.registry import Registry



@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    group_size: int = 1           # completions per prompt


class RolloutEngine(Protocol):
    def generate(self, batch: dict[str, torch.Tensor], params: SamplingParams, seed: int,
                 group_seeds: list[int] | None = None) -> torch.Tensor:
        """batch: processor output for B prompts (left-padded). Returns completion ids [B * G, C]. group_seeds
        [B]: prompt b's G rows are sampled from their own generator seeded group_seeds[b], so a group is the same
        whatever else is in the batch (several processes hold other groups); engines that cannot (HF generate)
        ignore it and sample the batch from `seed`."""

    def sync_weights(self) -> None:
        """Called after each optimizer step (engines holding their own copy of the weights reload them)."""


class HFEngine:
    """transformers `generate` on the policy's own model (no weight copy: sync is a no-op)."""

    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, suppress_ids: list[int] = ()):
        self.model, self.eos_id, self.pad_id, self.suppress_ids = model, eos_id, pad_id, list(suppress_ids)

    @torch.no_grad()
    def generate(self, batch, params, seed, group_seeds=None):
        torch.manual_seed(seed)
        greedy = params.temperature == 0
        kw = dict(do_sample=not greedy, max_new_tokens=params.max_new_tokens, num_return_sequences=params.group_size,
                  eos_token_id=self.eos_id, pad_token_id=self.pad_id, use_cache=True,
                  suppress_tokens=self.suppress_ids or None)
        if not greedy:
            kw.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        was_training = self.model.training
        self.model.eval()
        try:
            seqs = self.model.generate(**batch, **kw)
        finally:
            self.model.train(was_training)
        return pad_after_eos(seqs[:, batch["input_ids"].shape[1]:], self.eos_id, self.pad_id)

    def sync_weights(self):
        pass


class PrefixCacheEngine:
    """Each prompt is prefilled once (with its media) and its KV cache indexed out to its G rows, then tokens
    are decoded against that cache: a group never pays G times for a long video prompt or the vision tower.
    The prefill and the position ids are the policy's own (`prefill(batch, rows) -> (logits [n, V], cache,
    first position [n], prompt mask [n, P])`), the ones its shared-prefix scoring uses, so sampling and
    scoring see one distribution (greedy output equals HF `generate`; tests/test_vlm_policy.py)."""

    def __init__(self, model: torch.nn.Module, prefill, eos_id: int, pad_id: int, suppress_ids: list[int] = ()):
        self.model, self.prefill, self.eos_id, self.pad_id = model, prefill, eos_id, pad_id
        self.suppress_ids = list(suppress_ids)
        # several processes with a sharded model (FSDP): every rank must run the same number of forwards, so a
        # rank that is done keeps decoding (padding) until all are; all_done(bool) -> bool agrees across ranks
        self.all_done = None
        self.last_logprobs: torch.Tensor | None = None  # [n, C] log-prob of each sampled token (NaN after EOS)

    @torch.no_grad()
    def generate(self, batch, params, seed, group_seeds=None):
        n_prompts = batch["input_ids"].shape[0]
        device = batch["input_ids"].device
        rows = torch.arange(n_prompts, device=device).repeat_interleave(params.group_size)   # [n]
        gen = [torch.Generator(device).manual_seed(s) for s in group_seeds] if group_seeds is not None \
            else torch.Generator(device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            logits, cache, start, mask = self.prefill(batch, rows)                           # [n, V] ...
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            out, lps = [], []
            for k in range(params.max_new_tokens):
                tok = self._pick(logits, params, gen).masked_fill(done, self.pad_id)          # [n]
                out.append(tok)
                lps.append(self._log_prob(logits, tok, params).masked_fill(done, float("nan")))
                alive = ~done                     # this step's token is real (EOS included)
                done = done | (tok == self.eos_id)
                finished = bool(done.all())
                if self.all_done is not None:
                    finished = self.all_done(finished)
                if finished or k == params.max_new_tokens - 1:
                    break
                mask = torch.cat([mask, alive.long()[:, None]], 1)
                logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=(start + k)[:, None],
                                    past_key_values=cache, use_cache=True).logits[:, -1]
        finally:
            self.model.train(was_training)
        self.last_logprobs = torch.stack(lps, 1).cpu()
        return torch.stack(out, 1)                                                           # [n, C]

    def _log_prob(self, logits, tok, params):
        """[n] log-prob of `tok` under the distribution the policy scores (temperature, suppressed tokens; not the
        top-p truncation); NaN when greedy."""
        if params.temperature == 0:
            return torch.full(tok.shape, float("nan"), device=tok.device)
        logits = logits.float()
        if self.suppress_ids:
            logits = logits.clone()
            logits[:, self.suppress_ids] = float("-inf")
        return torch.log_softmax(logits / params.temperature, -1).gather(1, tok[:, None]).squeeze(1)

    def _pick(self, logits, params, gen):
        """[n] tokens from logits [n, V]; gen: one generator, or one per group of params.group_size rows."""
        if isinstance(gen, list):
            g = params.group_size
            return torch.cat([self._pick(logits[b * g:(b + 1) * g], params, one) for b, one in enumerate(gen)])
        logits = logits.float()
        if self.suppress_ids:
            logits[:, self.suppress_ids] = float("-inf")
        if params.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / params.temperature, -1)
        if params.top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)

    def sync_weights(self):
        pass


def pad_after_eos(ids: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """[n, C] ids with every token after the first EOS replaced by pad_id (the EOS itself is kept)."""
    return ids.masked_fill(completion_mask(ids, eos_id) == 0, pad_id)


def completion_mask(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[n, C] bool: tokens up to and including the first EOS (all tokens when there is none)."""
    is_eos = ids == eos_id
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    return ~after


def _prefix_cache(policy, options: dict) -> PrefixCacheEngine:
    return PrefixCacheEngine(policy.model, policy.prefill, policy.eos_id, policy.pad_id, policy.suppress_ids)


def _hf(policy, options: dict) -> HFEngine:
    return HFEngine(policy.model, policy.eos_id, policy.pad_id, policy.suppress_ids)


# sampler.engine of token policies: name -> build(policy, sampler.vllm options) -> RolloutEngine. An engine reads the
# policy's model, prefill, eos / pad ids and suppressed ids; a user's own engine loads by import path (package.module:fn)
ENGINES = Registry("rollout engine (sampler.engine)", {
    "prefix_cache": _prefix_cache, "hf": _hf, "vllm": "mmrl.rollout.vllm_engine:build"})
