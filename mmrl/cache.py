"""A bounded LRU cache for tensors: decoded videos, processed prompts, text embeddings."""

from __future__ import annotations

from collections import OrderedDict

import torch


def nbytes(value) -> int:
    """Bytes held by the tensors in a value (a tensor, or a tuple / list / dict of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class BoundedCache:
    """LRU cache bounded by entries AND by the bytes of the tensors it holds (decoded frames are large: a
    Charades clip at 2 fps and 448 px is ~70 MB in float32). Counts hits and misses."""

    def __init__(self, capacity: int = 256, max_bytes: float = 2 * 2**30):
        self.capacity, self.max_bytes, self._d, self.bytes = capacity, max_bytes, OrderedDict(), 0
        self.hits = self.misses = 0

    def get(self, key, make):
        """The cached value of key (now the most recent), or make()'s, cached; make=None: None when absent."""
        if key in self._d:
            self.hits += 1
            self._d.move_to_end(key)
            return self._d[key][0]
        if make is None:
            return None
        self.misses += 1
        value = make()
        size = nbytes(value)
        self._d[key] = (value, size)
        self.bytes += size
        while len(self._d) > 1 and (len(self._d) > self.capacity or self.bytes > self.max_bytes):
            _, (_, old) = self._d.popitem(last=False)
            self.bytes -= old
        return value

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

