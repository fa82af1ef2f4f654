"""A fake accelerator for catching device mismatches on a machine without one.

On a GPU, an op that mixes a CUDA tensor with a CPU tensor raises ("Expected all tensors to be on the same
device"). On CPU every tensor shares one device, so such bugs stay invisible until a user's first GPU run.
`fake_accelerator()` makes a second device that computes on CPU: a tensor "on" it is a wrapper subclass that
reports `device == FAKE` (the `meta` device type, whose device guard is a no-op, so no CUDA runtime is
touched) and holds a real CPU tensor with the values. Inside the context, every op is checked with the
rules CUDA applies:
  - tensors on FAKE and on CPU may not meet in one op, except CPU scalars (0-dim), CPU index tensors of
    indexing ops (`x[idx]`, `x[idx] = v`), and copies between devices (`.to`, `copy_`);
  - factories (`torch.zeros(..., device=FAKE)`, `torch.randn(...)`) and `.to(FAKE)` put tensors on FAKE;
  - `.numpy()` of a FAKE tensor raises, as it does for a CUDA tensor; `.item()`, `.tolist()` and `.cpu()`
    work (a real GPU syncs there).
`torch.Generator(FAKE)` gives a CPU generator (a real run uses one on its device). `from_pretrained` of
transformers and diffusers models runs outside the checks (they build on the real meta device): the weights load
on CPU and the caller's `.to(device)` moves them, as on a GPU. Not caught: a CPU generator given to a factory on
FAKE (CUDA refuses it); not supported: autocast on FAKE (the bf16 path is checked on CPU).

Usage: `with fake_accelerator(): policy = build(cfg with model.device="meta"); trainer.step(0)`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FAKE = torch.device("meta")

# ops that CUDA runs with CPU operands: cross-device copies, and indexing with CPU index tensors
_CROSS_DEVICE = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.copy.default,
                 torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                 torch.ops.aten._index_put_impl_.default, torch.ops.aten.lift_fresh.default,
                 torch.ops.aten.set_.source_Tensor, torch.ops.aten._has_compatible_shallow_copy_type.default}


class DeviceMismatch(RuntimeError):
    """An op mixed accelerator and CPU tensors: CUDA would raise here."""


class OnFake(torch.Tensor):
    """A tensor on the fake accelerator: reports device FAKE, keeps its values in `elem` (a CPU tensor)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                   device=FAKE, requires_grad=elem.requires_grad,
                                                   storage_offset=elem.storage_offset())

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self):
        return f"OnFake({self.elem!r})"

    def tolist(self):  # a GPU tensor's tolist syncs and copies
        return self.elem.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert an accelerator tensor to numpy: use Tensor.cpu() to copy it to host first")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a fake-accelerator tensor outside fake_accelerator()")


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == FAKE.type


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        on_fake = any(isinstance(t, OnFake) for t in flat)
        plain = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnFake)]
        if any(t.is_meta for t in plain):  # made on the meta device behind the mode's back: it has no values
            raise RuntimeError(f"{func} got a value-less meta tensor; fake_accelerator() must learn how it was made")
        host = [t for t in plain if t.dim() > 0]
        if on_fake and host and func not in _CROSS_DEVICE:
            shapes = ", ".join(str(tuple(t.shape)) for t in host[:3])
            raise DeviceMismatch(f"Expected all tensors to be on the same device: {func} got tensors on the "
                                 f"accelerator and CPU tensors of shape {shapes}")
        unwrap = lambda t: t.elem if isinstance(t, OnFake) else t  # noqa: E731
        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        to_fake = on_fake
        if "device" in kwargs:  # a factory or a copy names where its output goes
            to_fake = _is_fake(kwargs["device"])
            if to_fake:
                kwargs["device"] = torch.device("cpu")
        elif func is torch.ops.aten.copy_.default:  # dst.copy_(src) stays on dst's device
            to_fake = isinstance(flat[0], OnFake)
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default or func is torch.ops.aten.set_.source_Tensor:
            return flat[0] if isinstance(flat[0], OnFake) else out
        return tree_map(lambda t: OnFake(t) if to_fake and isinstance(t, torch.Tensor) else t, out)


_RealGenerator = torch.Generator


class _DataFactories(TorchFunctionMode):
    """torch.tensor / torch.as_tensor with device=FAKE build on the real meta device without dispatching an
    op: build them on CPU and move them (a dispatched copy the mode sees)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnFake):
            # x[..., [1, 2]]: torch builds the list's index tensor on x's (meta) device; build it on CPU
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            idx = tuple(torch.tensor(i) if isinstance(i, list) else i for i in idx)
            return func(args[0], idx, *args[2:], **kwargs)
        if func not in (torch.tensor, torch.as_tensor):
            return func(*args, **kwargs)
        # data given as accelerator tensors (e.g. a list of scalars) is read as a GPU would read it: a copy
        if args and isinstance(args[0], (list, tuple)):
            args = (tree_map(lambda t: t.elem if isinstance(t, OnFake) else t, args[0]), *args[1:])
        if _is_fake(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to(FAKE)
        return func(*args, **kwargs)


class _Generator(_RealGenerator):
    """torch.Generator that accepts the fake device (and gives a CPU generator for it)."""

    def __new__(cls, device="cpu"):
        return _RealGenerator.__new__(cls, "cpu" if _is_fake(device) else device)


def _loaders() -> list[tuple[type, str]]:
    """from_pretrained of the model classes: they build on the real meta device, so they run outside the mode
    (the weights load on CPU; the caller's `.to(device)` then moves them to FAKE, as it moves them to a GPU)."""
    out = []
    with contextlib.suppress(ImportError):
        import transformers

        out.append((transformers.PreTrainedModel, "from_pretrained"))
    with contextlib.suppress(ImportError):
        import diffusers

        out += [(diffusers.ModelMixin, "from_pretrained"), (diffusers.DiffusionPipeline, "from_pretrained")]
    return out


def _outside_mode(fn):
    from torch.utils._python_dispatch import _disable_current_modes

    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def fake_accelerator():
    """Inside: `FAKE` is an accelerator; mixing its tensors with CPU tensors raises DeviceMismatch."""
    real_gen, patched = torch.Generator, []
    torch.Generator = _Generator
    for owner, name in _loaders():
        real = owner.__dict__[name]
        patched.append((owner, name, real))
        setattr(owner, name, classmethod(_outside_mode(real.__func__)))
    try:
        with _Mode(), _DataFactories():
            yield FAKE
    finally:
        torch.Generator = real_gen
        for owner, name, real in patched:
            setattr(owner, name, real)
