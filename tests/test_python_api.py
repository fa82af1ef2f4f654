"""docs/python-api.md's example runs as written (in its quick form): a config from code, a reward as a plain
function registered by name, training, and the held-out evaluation of the run folder."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_python_api_example_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "docs/examples/python_api.py"), "--smoke"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained:" in r.stdout and "after 2 iterations" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if "centered" in ln and "on 12 prompts" in ln]
    assert len(lines) == 2 and lines[0].startswith("base (") and "runs/python_api" in lines[1]


def test_the_public_api_resolves_and_import_mmrl_stays_light():
    """Every name of mmrl.__all__ resolves to what its module defines; `import mmrl` itself imports no torch (the
    names load on first use, so the command line starts fast)."""
    import importlib

    import mmrl

    for name in mmrl.__all__:
        assert getattr(mmrl, name) is getattr(importlib.import_module(mmrl._API[name]), name), name
    r = subprocess.run([sys.executable, "-c", "import sys, mmrl; print('torch' in sys.modules)"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr[-2000:]
    try:
        mmrl.nope
    except AttributeError as e:
        assert "the public API: " in str(e)
    else:
        raise AssertionError("mmrl.nope resolved")
