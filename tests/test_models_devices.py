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
