"""Two "nodes" on localhost (two separate torchrun launches, 1 process each, gloo on CPU) train as one DDP job and end
where a single process with the same global batch ends: the multi-node launch lines of docs/scale-out.md work."""

import os
import subprocess
import sys

import pytest
from nodes import launch_nodes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/dist_matrix.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def single_process(tiny_pixel_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single")
    r = subprocess.run([sys.executable, WORKER, tiny_pixel_model, str(out), "--parallel", "none", "--features",
                        "plain"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out / "plain.safetensors")


@pytest.mark.parametrize("backend", ["static", pytest.param("c10d", marks=pytest.mark.slow)])  # c10d: the same run, ~20 s
def test_two_nodes_end_where_one_process_ends(backend, single_process, tiny_pixel_model, tmp_path):
    """3 prompts x 4 samples, 2 minibatches, 2 iterations (dist_matrix's `plain`): node 0 samples groups [0, 1.5),
    node 1 the rest (a group spans the nodes); only global rank 0 writes."""
    args = [WORKER, tiny_pixel_model, str(tmp_path / "nodes"), "--parallel", "ddp", "--features", "plain"]
    text = launch_nodes(args, tmp_path, cwd=ROOT, env=ENV, backend=backend)
    assert "plain: world 2" in "".join(text)
    two = load_file(tmp_path / "nodes/plain.safetensors")
    assert single_process.keys() == two.keys()
    diff = max((single_process[k] - two[k]).abs().max().item() for k in two)
    assert diff < 1e-6, f"two nodes: parameters differ from the single-process run by {diff}"


@pytest.mark.parametrize("nodes", [2, 4])
def test_multinode_accelerate_config_launches_8_per_node(nodes):
    """configs/accelerate/multinode.yaml with the documented flags resolves, through accelerate's own launcher, to
    8 processes on each of `nodes` nodes; without --num_processes accelerate refuses to start (no stale total)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = os.path.join(ROOT, "configs/accelerate/multinode.yaml")
    head = ["--config_file", config, "--machine_rank", "1", "--main_process_ip", "127.0.0.1"]
    tail = ["-m", "mmrl.cli", "train", "CONFIG"]
    parser = launch_command_parser()
    args, _, _ = _validate_launch_command(parser.parse_args(
        [*head, "--num_machines", str(nodes), "--num_processes", str(8 * nodes), *tail]))
    prepare_multi_gpu_env(args)
    assert (args.nproc_per_node, args.nnodes) == ("8", str(nodes))
    with pytest.raises(ValueError, match="num_processes"):
        _validate_launch_command(parser.parse_args([*head, "--num_machines", str(nodes), *tail]))
    docs = open(os.path.join(ROOT, "docs/scale-out.md")).read()
    assert "--num_processes $((8 * NNODES))" in docs and "GLOO_SOCKET_IFNAME" in docs
