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
