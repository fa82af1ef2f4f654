"""Loopback load test of the reward server (mmrl/reward_server.py), and its failure when killed.

    python benchmarks/bench_reward_server.py                  # 4 clients x 16 images per request, 15 s
    python benchmarks/bench_reward_server.py --quick          # 3 s

Starts `mmrl serve-reward REWARD` in its own process, scores the same images in-process first (the reference
throughput), then runs --clients threads that each send requests of --batch images back to back for --seconds.
Reports requests/s, samples/s, p50 / p95 / max latency, the server's merged batches and 503s (backpressure).
Then it kills the server and times how long a client call takes to fail (bounded by its timeout and retries).
The last line is one JSON object.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward", default="shapes")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="images per request")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--queue", type=int, default=8, help="server queue size (503 beyond it)")
    p.add_argument("--quick", action="store_true", help="3 s of load")
    args = p.parse_args(argv)
    import torch

    from mmrl.reward import REWARDS
    from mmrl.reward_server import RemoteReward, RewardServerError
    from tasks import shapes

    torch.set_num_threads(1)
    ps = shapes.prompts("train")[:args.batch]
    imgs = torch.stack([shapes.to_tensor(shapes.render(q.spec, 24, random.Random(i))) for i, q in enumerate(ps)])
    ex = [{"prompt": q.text} for q in ps]
    local = REWARDS[args.reward]()
    t0, n_local = time.time(), 0
    while time.time() - t0 < 2.0:
        local(imgs, ex)
        n_local += len(ex)
    local_sps = n_local / (time.time() - t0)

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "serve-reward", args.reward, "--port", str(port),
                             "--queue", str(args.queue)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        print(proc.stdout.readline().strip(), flush=True)
        url = f"http://127.0.0.1:{port}"
        seconds = 3.0 if args.quick else args.seconds
        lat, errors, stop = [], [], time.time() + seconds
        clients = [RemoteReward(url, timeout_s=30, retries=20, backoff_s=0.05) for _ in range(args.clients)]

        def client(c):
            while time.time() < stop:
                t = time.perf_counter()
                try:
                    c(imgs, ex)
                    lat.append(time.perf_counter() - t)
                except RewardServerError as e:
                    errors.append(str(e))

        t0 = time.time()
        ths = [threading.Thread(target=client, args=(c,)) for c in clients]
        [t.start() for t in ths]
        [t.join() for t in ths]
        wall = time.time() - t0
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
        q = statistics.quantiles(lat, n=20) if len(lat) >= 2 else [float("nan")] * 19
        load = {"requests": len(lat), "requests_per_s": round(len(lat) / wall, 2),
                "samples_per_s": round(len(lat) * args.batch / wall, 1), "local_samples_per_s": round(local_sps, 1),
                "latency_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
                "latency_p95_ms": round(1000 * q[18], 1), "latency_max_ms": round(1000 * max(lat), 1) if lat else None,
                "server_batches": health["batches"], "server_requests": health["requests"],
                "server_503": health["rejected"], "client_retries": sum(c.stats["retries"] for c in clients),
                "client_errors": len(errors)}
        print(f"load: {load}", flush=True)
    finally:
        proc.kill()
        proc.wait()
    c = RemoteReward(url, timeout_s=2.0, retries=2, backoff_s=0.25)
    t0 = time.time()
    try:
        c(imgs, ex)
        failed = None
    except RewardServerError as e:
        failed = str(e)[:120]
    fault = {"seconds_to_error": round(time.time() - t0, 2), "bound_s": 3 * 2.0 + 0.25 + 0.5, "tries": c.stats["tries"],
             "error": failed}
    print(f"killed server: {fault}", flush=True)
    print(json.dumps({"reward": args.reward, "clients": args.clients, "batch": args.batch, "seconds": seconds,
                      "load": load, "killed_server": fault}))


if __name__ == "__main__":
    main()
