"""The data that flows through the trainer, and the shape glossary used across mmrl.

Shape glossary (one name per concept):
    B  prompts per iteration          G  group_size (samples per prompt)
    N  = B * G samples                A  actions per sample (denoising steps or tokens)
    n  samples in a minibatch         *D the latent dims of one action's state, e.g. (C, H, W)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from mmrl.errors import ConfigError


class RowView(Mapping):
    """Rows `index` of per-sample tensors {name: [N, ...]} on `device`, each gathered on first read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], index: torch.Tensor, device):
        self.tensors, self.index, self.device, self.cut = tensors, index, device, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.cut:
            self.cut[key] = self.tensors[key][self.index].to(self.device)
        return self.cut[key]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


@dataclass
class Rollout:
    """What `policy.sample` returns: everything the objective needs, indexed by sample along dim 0."""

    group_id: torch.Tensor        # [N] long: samples with one id share a prompt; advantages are relative within it
    old_log_prob: torch.Tensor    # [N, A] log-prob of each action when it was sampled; NaN rows = deferred
                                  # (see Policy.defer_old_log_prob: the trainer's first pass fills them)
    action_mask: torch.Tensor     # [N, A] bool: actions that enter the loss
    examples: list[dict]          # [N] the task examples ({"prompt": ..., ...}), repeated per group member
    outputs: Any                  # images [N, 3, H, W] in [-1, 1] | list[str] of N completions
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample tensors [N, ...] log_prob needs
    is_offpolicy: torch.Tensor | None = None  # [N] bool: injected samples (TempSamp-R1); None = all on-policy

    def __post_init__(self):
        n = self.group_id.shape[0]
        if self.is_offpolicy is None:
            self.is_offpolicy = torch.zeros(n, dtype=torch.bool)
        for name in ("old_log_prob", "action_mask", "is_offpolicy"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"Rollout.{name} has {getattr(self, name).shape[0]} rows, group_id has {n}")
        for k, v in (self.extras.items() if isinstance(self.extras, dict) else ()):  # a RowView is cut already
            if v.shape[0] != n:
                raise ValueError(f"Rollout.extras[{k!r}] has {v.shape[0]} rows, group_id has {n}")

    def __len__(self) -> int:
        return self.group_id.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """The rows `index` [n] of every per-sample field."""
        idx = index.tolist()
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[index]
            elif isinstance(v, dict):
                out[f.name] = {k: t[index] for k, t in v.items()}
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx]
            else:
                out[f.name] = v
        return Rollout(**out)

    def view(self, index: torch.Tensor, device: torch.device | str) -> "Rollout":
        """The rows `index` [n] on `device`, each extra gathered when first read (RowView), the outputs left out: a
        training pass moves only the stored tensors its loss reads, not the rollout's latents or images."""
        return Rollout(group_id=self.group_id[index].to(device), old_log_prob=self.old_log_prob[index].to(device),
                       action_mask=self.action_mask[index].to(device), examples=[self.examples[i] for i in index.tolist()],
                       outputs=None, extras=RowView(self.extras, index, device),
                       is_offpolicy=self.is_offpolicy[index].to(device))

    def to(self, device: torch.device | str) -> "Rollout":
        """The same rollout with every tensor field (extras included) on `device`; examples and outputs as they
        are. The trainer keeps bookkeeping (group ids, masks, rewards) on CPU and moves a minibatch to the device
        of its log-probs for the loss."""
        return Rollout(group_id=self.group_id.to(device), old_log_prob=self.old_log_prob.to(device),
                       action_mask=self.action_mask.to(device), examples=self.examples, outputs=self.outputs,
                       extras={k: v.to(device) for k, v in self.extras.items()},
                       is_offpolicy=self.is_offpolicy.to(device))

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        """One rollout of all rows of `parts`; group ids are renumbered so groups stay distinct, and [N, A]
        tensors of different action lengths (token completions) are right-padded (mask False, values 0)."""
        gids, offset = [], 0
        for p in parts:
            dense = torch.unique(p.group_id, return_inverse=True)[1]
            gids.append(dense + offset)
            offset += int(dense.max()) + 1 if len(p) else 0

        def cat(ts):
            if ts[0].dim() >= 2 and len({t.shape[1] for t in ts}) > 1:
                a = max(t.shape[1] for t in ts)
                ts = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, a - t.shape[1])) for t in ts]
            return torch.cat(ts)

        return Rollout(group_id=torch.cat(gids), old_log_prob=cat([p.old_log_prob for p in parts]),
                       action_mask=cat([p.action_mask for p in parts]),
                       examples=[e for p in parts for e in p.examples],
                       outputs=torch.cat([p.outputs for p in parts]) if isinstance(parts[0].outputs, torch.Tensor)
                       else [o for p in parts for o in p.outputs],
                       extras={k: cat([p.extras[k] for p in parts]) for k in parts[0].extras},
                       is_offpolicy=torch.cat([p.is_offpolicy for p in parts]))


@dataclass
class PolicyOutput:
    """What `policy.log_prob` returns for a minibatch of n samples."""

    log_prob: torch.Tensor                                   # [n, A]
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. flow: "mean" [n, A, *D], "std" [n, A]


def group_ids(batch_size: int, group_size: int) -> torch.Tensor:
    """[B * G] group ids 0,0,..,1,1,.. for B prompts each repeated group_size times."""
    return torch.arange(batch_size).repeat_interleave(group_size)


def whole_groups(rows: torch.Tensor, group_size: int) -> list[int]:
    """The groups of `rows` [n], which must be whole groups (tree and branching rollouts sample a prompt at once)."""
    groups = (rows[::group_size] // group_size).tolist()
    if not torch.equal(rows, torch.tensor([g * group_size + j for g in groups for j in range(group_size)],
                                          dtype=rows.dtype)):
        raise ValueError("tree and per-step branching rollouts sample whole groups: rows must be whole groups")
    return groups


def stratified_minibatches(group_id: torch.Tensor, minibatches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The rows [n_m] of each of `minibatches` minibatches of one epoch, stratified by group: the rows are laid out
    group after group (by group id; a group's rows in a seeded random order) and dealt round-robin, so every
    minibatch takes G / minibatches rows of every group (+-1) and minibatch sizes differ by one row at most.
    Why: ranks hold whole groups, so a rank holds the same share of every minibatch (in proportion to its groups)
    and no rank waits for another at a gradient sync; the split depends only on the group ids and the seed, not on
    the world size, so N processes train the single process's minibatches. group_id: [N] (single-process order)."""
    order = torch.randperm(len(group_id), generator=generator)                            # [N] a seeded shuffle
    order = order[torch.sort(group_id[order], stable=True).indices]                       # [N] grouped by id
    return [order[m::minibatches] for m in range(minibatches)]


def in_chunks(fn, size: int, *tensors: torch.Tensor) -> torch.Tensor:
    """fn(*tensors) computed on chunks of `size` rows (dim 0) and concatenated, when no gradient is recorded
    (peak memory is then one chunk's); with gradients, or size 0, in one call."""
    n = len(tensors[0])
    if not size or size >= n or torch.is_grad_enabled():
        return fn(*tensors)
    return torch.cat([fn(*(t[i:i + size] for t in tensors)) for i in range(0, n, size)])


def micro_batches(action_mask: torch.Tensor, idx: torch.Tensor, size: int, per_action: bool):
    """(rows [n'], actions [n', A] bool or None) parts of minibatch `idx` with at most `size` rows per training
    forward (0 = the whole minibatch): transitions when the policy scores actions independently (`per_action`,
    flow), whole sequences otherwise. None = every trained action of the rows. action_mask: [N, A]."""
    if not size:
        yield idx, None
        return
    if not per_action:
        yield from ((part, None) for part in idx.split(size))
        return
    mask = action_mask[idx]                                                # [n, A]
    pairs = mask.nonzero()                                                 # [k, 2] (row in idx, action)
    if not len(pairs):
        yield idx, None
        return
    for chunk in pairs.split(size):
        rows, inv = torch.unique(chunk[:, 0], return_inverse=True)
        actions = torch.zeros(len(rows), mask.shape[1], dtype=torch.bool)
        actions[inv, chunk[:, 1]] = True
        yield idx[rows], actions


def condition_images(example: dict, count: int) -> list:
    """The conditioning images of an example (image edits, image-to-video) as RGB PIL images: its `image` (one path
    or image) or `images` (a list) field. count: how many the model takes (-1: one or more)."""
    from PIL import Image

    items = example.get("images", example.get("image"))
    if items is None:
        raise ConfigError(f"the model conditions on {'one or more images' if count < 0 else f'{count} image(s)'}, but "
                          f"example {example.get('prompt', '')[:60]!r} has no `image` or `images` field; give each "
                          f"prompt its image, e.g. a JSONL row {{\"prompt\": ..., \"image\": \"path.png\"}}")
    items = [items] if isinstance(items, (str, Image.Image)) else list(items)
    if count > 0 and len(items) != count:
        raise ConfigError(f"the model takes {count} conditioning image(s); example {example.get('prompt', '')[:60]!r} "
                          f"has {len(items)}")
    out = []
    for item in items:
        if isinstance(item, Image.Image):
            out.append(item.convert("RGB"))
            continue
        try:
            with Image.open(item) as im:
                image = im.convert("RGB")
        except (OSError, ValueError) as e:
            raise ConfigError(f"conditioning image {item!r} of {example.get('prompt', '')[:60]!r} does not read as an "
                              f"image ({e})") from None
        image.filename = str(item)  # the encoders' cache key
        out.append(image)
    return out


def load_image(path: str, side: int) -> torch.Tensor:
    """An image file as [3, side, side] in [-1, 1] (resized with bicubic resampling when its size differs)."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as im:
            image = im.convert("RGB")
    except (OSError, ValueError) as e:
        raise ConfigError(f"output image {path!r} does not read as an image ({e})") from None
    if image.size != (side, side):
        image = image.resize((side, side), Image.BICUBIC)
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
