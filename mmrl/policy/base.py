"""The Policy protocol: the one interface the trainer talks to, for every modality."""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

from mmrl.data import PolicyOutput, Rollout


class Policy(Protocol):
    def sample(self, examples: list[dict], group_size: int, generator: torch.Generator) -> Rollout:
        """Sample group_size outputs per example. Returns a Rollout of N = len(examples) * group_size rows."""

    def log_prob(self, rollout: Rollout, index: torch.Tensor) -> PolicyOutput:
        """Recompute log-probs [n, A] (with grad) of the stored actions of rows `index` [n]."""

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which log_prob runs the KL reference (adapters disabled, or a frozen copy)."""

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def save_pretrained(self, path: str) -> None: ...

    def load_trainable_state(self, path: str) -> None:
        """Load trainable weights written by save_pretrained (resume)."""

    @torch.no_grad()
    def evaluate(self, examples: list[dict], seed: int) -> object:
        """Deterministic evaluation outputs (e.g. ODE samples) for examples."""
