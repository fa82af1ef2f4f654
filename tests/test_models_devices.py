"""model.dtype and model.device, read in one place (mmrl/devices.py) by the flow and token builders and mmrl plan."""

import pytest
import torch

from mmrl.devices import indexed, resolve_device, torch_dtype
from mmrl.errors import ConfigError


def test_dtype_names():
    assert [torch_dtype(n) for n in ("float32", "bfloat16", "float16")] == [torch.float32, torch.bfloat16,
                                                                            torch.float16]
    with pytest.raises(ConfigError, match="model.dtype='fp16'.*float32, bfloat16, float16"):
        torch_dtype("fp16")


def test_device_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    with pytest.raises(ConfigError, match="model.device='gpu'.*auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")
    assert indexed("cpu") == torch.device("cpu") and indexed("cuda:1") == torch.device("cuda", 1)


def test_auto_threads_take_the_cores_other_processes_leave(monkeypatch):
    """train.threads=auto: 4 cores with a load of 2.6 from other processes -> 1 thread (4 - 2.6, rounded), at
    least 1 on a saturated machine, all 4 on a quiet one; OMP_NUM_THREADS, the user's choice, wins; a count is kept."""
    import os

    import torch

    from mmrl.devices import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for load, want in ((2.6, 1), (0.2, 4), (9.0, 1), (1.4, 3)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        cpu_threads.running = 0  # this process runs none yet
        assert cpu_threads("auto") == want, load
    assert cpu_threads(3) == 3 and cpu_threads(0) == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads("auto") == torch.get_num_threads()
