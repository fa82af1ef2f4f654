"""Several "nodes" on localhost for the multi-node tests: separate torchrun launches, one per node, rendezvousing
on a free port; their logs in files (not pipes: a node blocked on a full pipe would stall the other in a
collective)."""

import socket
import subprocess
import sys


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


def launch_nodes(args: list[str], logs_dir, *, cwd: str, env: dict, nodes: int = 2, per_node: int = 1,
                 backend: str = "static", timeout: float = 600) -> list[str]:
    """Run `args` (a script and its arguments) as `nodes` torchrun launches of `per_node` processes each; wait for all,
    assert they ended with 0, and return each node's log text."""
    port = free_port()
    logs = [open(logs_dir / f"node{r}.log", "w+") for r in range(nodes)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                               "--nproc_per_node", str(per_node), *rendezvous(backend, r, port), *args], cwd=cwd,
                              env=env, stdout=log, stderr=subprocess.STDOUT, text=True) for r, log in enumerate(logs)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read())
        log.close()
    assert [p.returncode for p in procs] == [0] * nodes, "".join(t[-3000:] for t in text)
    return text
