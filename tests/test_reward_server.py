"""The reward server and its client: exact results, batching across requests, backpressure, timeouts, a server
killed mid-run (retries, then a clear error or a counted skip; never a hang)."""

import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from mmrl.reward import REWARDS, RewardRunner
from mmrl.reward_server import RemoteReward, RewardServer, RewardServerError, decode_request, encode_request
from tasks import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(n=8, seed=0):
    ps = shapes.prompts("train")[:n]
    imgs = torch.stack([shapes.to_tensor(shapes.render(p.spec, 24, random.Random(seed + i))) for i, p in enumerate(ps)])
    return imgs, [{"prompt": p.text, "category": p.spec.category} for p in ps]


def test_wire_format_round_trip_without_pickle():
    imgs, ex = batch(3)
    out, ex2 = decode_request(encode_request(imgs, ex))
    assert torch.equal(out, imgs) and ex2 == ex
    texts, ex3 = decode_request(encode_request(["a", "b"], [{"x": 1}, {"x": 2}]))
    assert texts == ["a", "b"] and ex3 == [{"x": 1}, {"x": 2}]


def test_remote_equals_local_and_batches_requests():
    reward = REWARDS["shapes"]()
    calls = []

    def counted(outputs, examples):
        calls.append(len(examples))
        time.sleep(0.05)
        return reward(outputs, examples)

    srv = RewardServer(counted, "shapes", max_wait_ms=200).start()
    try:
        assert srv.url.startswith("http://127.0.0.1:")  # loopback by default
        client = RemoteReward(srv.url, timeout_s=10, retries=0)
        imgs, ex = batch()
        got, want = client(imgs, ex), reward(imgs, ex)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        # 4 concurrent requests of 2 samples are merged into fewer reward calls, each answered with its rows
        results = [None] * 4

        def worker(k):
            results[k] = client(imgs[2 * k:2 * k + 2], ex[2 * k:2 * k + 2])

        calls.clear()
        ths = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        assert len(calls) < 4 and sum(calls) == 8
        for k in range(4):
            assert torch.equal(results[k]["overall"], want["overall"][2 * k:2 * k + 2])
    finally:
        srv.close()


def test_backpressure_answers_503_and_the_client_retries():
    reward = REWARDS["shapes"]()

    def slow(outputs, examples):
        time.sleep(0.3)
        return reward(outputs, examples)

    srv = RewardServer(slow, queue_size=1, max_batch=1, max_wait_ms=0).start()
    try:
        imgs, ex = batch(1)
        clients = [RemoteReward(srv.url, timeout_s=10, retries=8, backoff_s=0.1) for _ in range(4)]
        out = [None] * 4
        ths = [threading.Thread(target=lambda k=k: out.__setitem__(k, clients[k](imgs, ex))) for k in range(4)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        assert all(o is not None and o["strict"][0] == 1.0 for o in out)
        assert srv.rejected > 0 and sum(c.stats["busy"] for c in clients) == srv.rejected
    finally:
        srv.close()


def test_a_reward_error_is_not_retried_and_names_the_cause():
    def broken(outputs, examples):
        raise ValueError("model weights missing")

    srv = RewardServer(broken).start()
    try:
        client = RemoteReward(srv.url, timeout_s=5, retries=3)
        with pytest.raises(RewardServerError, match="HTTP 500.*model weights missing"):
            client(*batch(2))
        assert client.stats["tries"] == 1
    finally:
        srv.close()


def test_a_slow_server_times_out_within_the_bound():
    srv = RewardServer(lambda o, e: time.sleep(5) or {"overall": torch.zeros(len(e))}).start()
    try:
        client = RemoteReward(srv.url, timeout_s=0.5, retries=1, backoff_s=0.1)
        t0 = time.time()
        with pytest.raises(RewardServerError, match="did not answer after 2 tries"):
            client(*batch(1))
        assert time.time() - t0 < 2 * 0.5 + 0.1 + 1.0  # (retries + 1) * timeout + backoff, plus slack
    finally:
        srv.close()


def test_server_killed_mid_run(tmp_path):
    """A real `mmrl serve-reward` process: it scores, is killed, and the next call retries then fails clearly
    (on_error=raise) or counts the whole batch as failed (on_error=skip)."""
    port = 20000 + os.getpid() % 20000
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "serve-reward", "shapes", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving reward" in proc.stdout.readline()
        client = RemoteReward(f"http://127.0.0.1:{port}", timeout_s=2, retries=2, backoff_s=0.1)
        imgs, ex = batch(4)
        assert client(imgs, ex)["strict"].tolist() == [1.0] * 4
        proc.kill()
        proc.wait()
        t0 = time.time()
        with pytest.raises(RewardServerError, match="did not answer after 3 tries.*serve-reward"):
            RewardRunner(client, "raise")(imgs, ex)
        assert time.time() - t0 < 3 * 2 + 0.3 + 1
        rewards, valid, failures = RewardRunner(client, "skip")(imgs, ex)
        assert failures == 4 and not valid.any()  # counted, not dropped; no per-sample retries (4 x 3 tries)
    finally:
        proc.kill()
