"""The run's dtype and device from their config names (`model.dtype`, `model.device`), written once: the flow and
token policy builders and `mmrl plan` read them here."""

from __future__ import annotations

import os

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


def cpu_threads(setting: int | str) -> int:
    """torch's CPU threads for train.threads: a count > 0 as given; 0 (or OMP_NUM_THREADS set in the environment,
    the user's own choice) leaves torch's; "auto": the cores this process may use that other processes leave free
    now (the 1-minute load average, less the threads this process runs itself), at least 1. On a busy machine more
    threads than free cores make each iteration far slower than the share of cores would (they wait on each other)."""
    if setting == "auto":
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        others = os.getloadavg()[0] - getattr(cpu_threads, "running", 0)
        cpu_threads.running = max(1, min(cores, int(cores - max(others, 0.0) + 0.5)))
        return cpu_threads.running
    return int(setting) or torch.get_num_threads()


def set_cpu_threads(setting: int | str) -> None:
    """Apply cpu_threads(setting) (the trainer at start and, for "auto", at every iteration)."""
    n = cpu_threads(setting)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
