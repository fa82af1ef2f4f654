"""scripts/flux_nan_matrix.py (issue 62, item 4): its --quick matrix on CPU has every cell, every cell that ran is
finite, bf16 gradients point where fp32's do; its anomaly probe names the op of a NaN backward."""

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "flux_nan_matrix.py")


def load_script():
    spec = importlib.util.spec_from_file_location("flux_nan_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fnm():
    return load_script()


@pytest.fixture(scope="module")
def quick(fnm):
    threads = torch.get_num_threads()
    try:
        return fnm.main(["--device", "cpu", "--quick"])  # about 15 s on one core
    finally:
        torch.set_num_threads(threads)


def test_quick_matrix_has_every_cell_and_cpu_is_finite(fnm, quick):
    keys = {c["key"] for c in quick["cells"]}
    want = {fnm.Cell("flux", *c).key for c in itertools.product(fnm.HEADS, fnm.PRECISIONS, fnm.CHECKPOINTING,
                                                                   fnm.ADVANTAGES, fnm.BACKENDS)}
    assert keys == want and len(quick["cells"]) == len(want) == 120
    for c in quick["cells"]:
        if c["backend"] in fnm.CPU_UNAVAILABLE:
            assert c["outcome"] == fnm.UNAVAILABLE, c
        else:  # default, math and CPU's own flash kernel run
            assert c["outcome"] == "finite", c
            assert c["nonfinite_modules"] == [] and c["grad_nonfinite_blocks"] == [] and c["velocity_finite"]
            assert c["missing_grads"] == 0 and c["tensors"] == 22  # 11 adapted linears x (A, B)
            zero = c["advantage"] == "zero"
            assert (c["grad_norm"] == 0) == zero, c  # zero advantages: exactly zero gradients
    assert quick["first_nonfinite"] is None and quick["probes"] is None
    assert quick["summary"]["cells"] == 120 and quick["summary"]["finite"] == 72  # default, math, flash x 24


def test_bf16_gradients_agree_with_fp32(quick):
    comp = quick["comparison"]
    assert set(comp) == {f"flux/h{h}/{p}_vs_fp32" for h in (16, 128) for p in ("bf16", "bf16_autocast")}
    for name, c in comp.items():
        assert c["cosine"] > 0.9, (name, c["cosine"])  # measured 0.971 (head 16), 0.937 (head 128)
        assert 0.8 < c["norm_ratio"] < 1.25, (name, c["norm_ratio"])
        # step one: B = 0, so every lora_A's gradient is exactly zero and only the 11 B's are compared
        assert c["tensors_compared"] == 11 and c["tensors_zero_in_fp32"] == 11


def test_last_stdout_line_is_the_json(quick, capsys):
    # main() printed the JSON last (the fixture's output may have been captured by an earlier test: re-run small)
    fnm = load_script()
    threads = torch.get_num_threads()
    try:
        fnm.main(["--device", "cpu", "--quick", "--head-dim", "16", "--size", "8", "--text-len", "8"])
    finally:
        torch.set_num_threads(threads)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(json.loads(last)["cells"]) == 60


def test_anomaly_names_the_nan_op(fnm):
    def nan_backward():
        x = torch.zeros(3, requires_grad=True)
        (torch.sqrt(x) * 0).sum().backward()  # d sqrt / dx at 0 is inf, times a zero gradient: NaN

    out = fnm.anomaly_op(nan_backward)
    assert out["op"] == "SqrtBackward0" and "returned nan" in out["error"]
    assert fnm.anomaly_op(lambda: torch.ones(2, requires_grad=True).sum().backward())["op"] is None


def test_probes_on_a_nonfinite_cell(fnm):
    """A NaN advantage makes the cell non-finite everywhere: run_step reports it, the probes run."""
    base, sched = fnm.base_transformer(16, 0)
    b = fnm.make_batch(base, sched, 2, 8, 8, 4, 0, "cpu")
    b.adv[0] = float("nan")
    tr = fnm.with_lora(base, torch.bfloat16, 4, 8.0, 0, 0.0)
    cell = fnm.Cell("flux", 16, "bf16_autocast", True, "nonzero", "default")
    record, _ = fnm.run_step(tr, cell, b)
    assert record["outcome"] == "non-finite" and record["nonfinite_tensors"] == 22
    assert "transformer_blocks.0.attn.to_q.lora_B" in record["nonfinite_modules"]
    assert {"single_transformer_blocks.0[1]", "transformer_blocks.0[0]"} <= set(record["grad_nonfinite_blocks"])
    out = fnm.probes(tr, cell, b)
    assert out["cell"] == cell.key and isinstance(out["anomaly"]["op"], str)
    assert out["inputs_require_grad"]["outcome"] == "non-finite"


def test_help():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout and "--quick" in r.stdout
