"""KV caches of shared-prefix scoring (`TokenPolicy.score`) that may pass through checkpointed layers, and the module
that makes a scoring pass one DDP forward.

transformers drops a KV cache inside a gradient-checkpointed layer unless the layer declares that it can keep it
(`_can_checkpoint_with_cache`): a recompute in backward calls the cache's `update` a second time, and a cache that
grows by concatenation would then hold its keys twice. These two never grow: the prompt pass stores each layer's K/V
as computed (a recompute stores equal values again), and the completion pass reads its rows' prompt K/V and stores
nothing (a recompute reads the same tensors). So under checkpointing each prompt's layers are recomputed once in
backward, with the gradients of all the rows that read its K/V, instead of once per row.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


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
