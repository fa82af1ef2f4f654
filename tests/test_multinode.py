"""Two "nodes" on localhost (two separate torchrun launches, 1 process each, gloo on CPU) train as one DDP job and end
where a single process with the same global batch ends: the multi-node launch lines of docs/scale-out.md work."""

import os
import socket
import subprocess
import sys

import pytest
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/dist_matrix.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(backend: str, node_rank: int, port: int) -> list[str]:
    """static: node 0 hosts the store at master_addr:master_port, ranks follow node_rank. c10d: the store at
    rdzv_endpoint, ranks given by arrival (node_rank is ignored)."""
    if backend == "static":
        return ["--rdzv_backend", "static", "--node_rank", str(node_rank), "--master_addr", "127.0.0.1",
                "--master_port", str(port)]
    return ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "mmrl-multinode"]


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
    port = free_port()
    # files, not pipes: a node blocked on a full pipe would stall the other in a collective
    logs = [open(tmp_path / f"node{r}.log", "w+") for r in (0, 1)]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               *rendezvous(backend, r, port), *args], cwd=ROOT, env=ENV, stdout=log,
                              stderr=subprocess.STDOUT, text=True) for r, log in zip((0, 1), logs)]
    try:
        for n in nodes:
            n.wait(timeout=600)
    finally:
        for n in nodes:
            n.kill()
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read())
        log.close()
    assert [n.returncode for n in nodes] == [0, 0], text[0][-3000:] + text[1][-3000:]
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
