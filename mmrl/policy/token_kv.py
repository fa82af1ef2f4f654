"""Shared-prefix scoring of a token policy (`SharedPrefixScoring`, a part of TokenPolicy): each distinct prompt runs
once and its KV cache is indexed out to its rows; the KV caches that may pass through checkpointed layers, and the
module that makes a scoring pass one DDP forward.

transformers drops a KV cache inside a gradient-checkpointed layer unless the layer declares that it can keep it
(`_can_checkpoint_with_cache`): a recompute in backward calls the cache's `update` a second time, and a cache that
grows by concatenation would then hold its keys twice. These two never grow: the prompt pass stores each layer's K/V
as computed (a recompute stores equal values again), and the completion pass reads its rows' prompt K/V and stores
nothing (a recompute reads the same tensors). So under checkpointing each prompt's layers are recomputed once in
backward, with the gradients of all the rows that read its K/V, instead of once per row.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers.cache_utils import Cache, DynamicLayer

from mmrl.rollout.engine import completion_mask

log = logging.getLogger(__name__)


class PromptKV(DynamicLayer):
    """One layer's K/V of the prompt pass [U, heads, P, d], stored as computed; `batch_select_indices` (inherited)
    then indexes them out to the rows [n, heads, P, d]."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class RowKV(DynamicLayer):
    """One layer as the completion pass sees it: its rows' prompt K/V [n, heads, P, d] before the completion's own
    [n, heads, C, d], which are not stored."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)


class OneCall(torch.nn.Module):
    """`fn` as the forward of a module holding `model`. DDP wraps it so that a scoring pass of several model calls is
    one DDP forward: DDP's reducer marks each parameter ready once per backward and expects one forward before it
    (two forwards of the DDP model before one backward fail with 'Expected to mark a variable ready only once')."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class SharedPrefixScoring:
    """TokenPolicy's scoring forwards (its model, device, eos_id, is_vlm and checkpointed layers `_checkpointed`)."""

    def enable_gradient_checkpointing(self) -> None:
        """Checkpointed decoder layers; shared-prefix scoring keeps its KV caches through them (`score`): transformers'
        GradientCheckpointingLayer, the layers of its built-in models."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.model.gradient_checkpointing_enable()
        self._checkpointed = [m for m in self.model.modules()
                              if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        if not self._checkpointed and self.shared_prefix:  # a model checkpointing its own way may drop the cache
            log.info("train.gradient_checkpointing: %s has no transformers GradientCheckpointingLayer to keep the KV "
                     "cache in: shared-prefix scoring is off (one [prompt | completion] forward per row)",
                     type(self.model).__name__)
            self.shared_prefix = False

    def score(self, batch: dict, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, C, V] of completions ids [n, C]. rows None: batch holds the n [prompt | completion] sequences,
        one forward. rows [n] (row -> prompt): batch holds the U distinct prompts, and each (with its media) runs once;
        its KV cache is indexed out to its rows, then the completion tokens run against it: two forwards, whatever
        U, n and C (several processes count on it). Equals the naive forward (same positions and mask;
        tests/test_vlm_policy.py); gradients flow into the prompt pass through the cache. Under gradient checkpointing
        both passes keep the cache through their checkpointed layers (mmrl/policy/token_kv.py): each prompt is
        recomputed once in backward, not once per row."""
        if rows is None:
            c = ids.shape[1]
            return self.model(**batch, use_cache=False, logits_to_keep=c + 1).logits[:, :c]
        with self._cache_through_checkpoints():
            first, prompt_kv, start, mask = self.prefill(batch, rows, Cache(layer_class_to_replicate=PromptKV))
            kv = Cache(layers=[RowKV(layer.keys, layer.values) for layer in prompt_kv.layers])
            # all C tokens run (the last one's logits unused): one completion forward even when C is 1
            mask = torch.cat([mask, completion_mask(ids, self.eos_id).long()], 1)          # [n, P + C]
            pos = start.unsqueeze(1) + torch.arange(ids.shape[1], device=self.device)      # [n, C]
            rest = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=kv,
                              use_cache=False).logits                                     # [n, C, V]
        return torch.cat([first[:, None], rest[:, :-1]], 1)                               # [n, C, V]

    @contextlib.contextmanager
    def _cache_through_checkpoints(self):
        """Checkpointed decoder layers keep the scoring caches (transformers drops a cache there unless the layer
        says it can keep it: a recompute would append to a growing cache a second time; the scoring caches never
        grow, so a recompute reads and writes what the forward did: mmrl/policy/token_kv.py)."""
        for m in self._checkpointed:
            m._can_checkpoint_with_cache = True
        try:
            yield
        finally:
            for m in self._checkpointed:
                del m._can_checkpoint_with_cache

    def prefill(self, batch: dict, rows: torch.Tensor, cache=None):
        """Run the U prompts of `batch` once and index them out to rows [n] (row -> prompt). Returns the logits
        of each row's first completion token [n, V], the KV cache [n, heads, P, d] per layer (into `cache` when
        given, else the model's own), the position of each row's first completion token [n] (completion tokens are
        text: one position each, continuing from the last prompt token) and the prompt attention mask [n, P]."""
        pos = self._prompt_positions(batch)                     # [U, P] or [3, U, P]; None: the model's arange
        # a cache given is filled whatever use_cache says (False: no warning that checkpointing turns it off)
        out = self.model(**{**batch, **({"position_ids": pos} if pos is not None else {})}, past_key_values=cache,
                         use_cache=cache is None, logits_to_keep=1)
        cache = out.past_key_values if cache is None else cache
        cache.batch_select_indices(rows)
        u, width = batch["attention_mask"].shape
        start = (pos[..., -1].view(-1, u).amax(0) + 1 if pos is not None
                 else torch.full((u,), width, device=self.device))                         # [U]
        return out.logits[:, -1][rows], cache, start[rows], batch["attention_mask"][rows]

    def _prompt_positions(self, batch: dict) -> torch.Tensor | None:
        """Position ids a full forward gives the prompt batch: counted over real tokens for causal LMs ([U, P],
        from _collate); M-RoPE ids from the model's own get_rope_index ([3, U, P]) for prompts with media; None
        for a VLM prompt without media (the model then uses a plain arange)."""
        if not self.is_vlm:
            return batch["position_ids"]
        if not any(k in batch for k in ("image_grid_thw", "video_grid_thw")):
            return None
        import inspect

        m = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        get_rope_index = m.model.get_rope_index
        accepted = inspect.signature(get_rope_index).parameters
        kw = {k: v for k, v in batch.items() if k in accepted and k != "input_ids"}
        return get_rope_index(batch["input_ids"], **kw)[0]
