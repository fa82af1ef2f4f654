"""The run's dtype and device from their config names (`model.dtype`, `model.device`), written once: the flow and
token policy builders and `mmrl plan` read them here."""

from __future__ import annotations

import torch

from mmrl.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # model.dtype -> torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `model.dtype` name ("float32" | "bfloat16" | "float16")."""
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not a dtype mmrl loads models in; set it to one of "
                          f"{', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> str:
    """A `model.device` name as torch spells it: "auto" is "cuda" when torch sees a GPU, else "cpu"; any other
    name ("cpu", "cuda", "cuda:1") is kept once torch accepts it."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"model.device={name!r} is not a device ({e}); set it to auto, cpu, cuda or cuda:N") from None
    return name


def indexed(device: str | torch.device) -> torch.device:
    """torch.device(device), with a CUDA device's index (this process's current device) filled in."""
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def set_tf32(device: str | torch.device, enabled: bool) -> None:
    """`train.tf32`: on a CUDA `device`, fp32 matmuls (cuBLAS) and convolutions (cuDNN) run on TF32 tensor cores
    (inputs rounded to a 10-bit mantissa, fp32 accumulation) when `enabled`, in IEEE fp32 otherwise. Other devices
    are left as they are (the CPU's oneDNN matmuls keep full fp32). Set through the per-backend `allow_tf32` flags:
    torch refuses to read a precision set partly through its newer `fp32_precision` API and partly through the older
    one, and torch.compile (inductor) and accelerate read the older one."""
    if torch.device(device).type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
