"""benchmarks/bench_scale.py --quick: 1 vs 2 processes for the three rollout kinds end with one JSON line whose
efficiencies are positive finite numbers and whose 2-process arm runs the 1-process arm's rows on each rank."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~40 s of a benchmark's quick mode
def test_bench_scale_quick():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1",
                                                                         "ACCELERATE_USE_CPU": "true"}
    r = subprocess.run([sys.executable, "benchmarks/bench_scale.py", "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"size", "steps", "group_size", "prompts_per_rank", "cpu_cores", "note", "results"} <= set(out)
    assert set(out["results"]) == {"chain", "tree", "nft"}
    for kind, res in out["results"].items():
        for key in ("efficiency", "rollout_efficiency", "train_efficiency"):
            assert math.isfinite(res[key]) and res[key] > 0, (kind, key, res[key])
        one, two = res["procs1"], res["procs2"]
        assert set(one) == set(two) == {"iter_s", "rollout_s", "train_s", "sample_rows_per_rank", "train_rows_per_rank"}
        # weak scaling: twice the prompts on twice the processes, the same rows on each rank
        assert one["sample_rows_per_rank"] == two["sample_rows_per_rank"] > 0
        assert one["train_rows_per_rank"] == two["train_rows_per_rank"] > 0
    # 1 prompt x 4 images, 4 steps, classifier-free guidance (2 rows per image and step): a chain samples 4 x 4 x 2
    # rows; a tree (splits at steps 1 and 2, branch 2; a split's children share their parent's forward) 1 + 1 + 2 + 4
    # nodes, x 2
    assert out["results"]["chain"]["procs1"]["sample_rows_per_rank"] == 32
    assert out["results"]["tree"]["procs1"]["sample_rows_per_rank"] == 16
