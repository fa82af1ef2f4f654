"""Reward serving over HTTP: a heavy reward model runs in its own process (or its own environment), batched
across requests; the trainer reaches it through `reward.name=remote` (RemoteReward).

    mmrl serve-reward shapes --port 8765            # loopback by default; --host 0.0.0.0 only on purpose

Wire format, no pickle: a request body is a safetensors file holding the outputs as the tensor "outputs"
(images [n, 3, H, W] / videos [n, 3, F, H, W]) and, in its metadata, JSON "examples" (and "texts" for text
outputs). The answer is a safetensors file of the reward tensors {key: [n]}.

    POST /score   200 rewards | 503 queue full (backpressure: retry later) | 504 not scored within
                  --request-timeout | 400 unreadable request | 500 the reward raised (its message)
    GET  /health  {"ok": true, "reward": NAME, "queued": k, "requests": r, "batches": b}

One worker thread scores: it takes a queued request, adds queued requests with outputs of the same shape
until --max-batch samples or --max-wait-ms, calls the reward once, and splits the result.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)


class RewardServerError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------- wire format
def encode_request(outputs, examples: list) -> bytes:
    meta = {"examples": json.dumps(list(examples), default=str)}
    if isinstance(outputs, torch.Tensor):
        return st_save({"outputs": outputs.detach().cpu().contiguous()}, metadata=meta)
    meta["texts"] = json.dumps(list(outputs))
    return st_save({"_": torch.zeros(1)}, metadata=meta)


def _metadata(body: bytes) -> dict:
    n = struct.unpack("<Q", body[:8])[0]  # safetensors: u64 header length, then the JSON header
    return json.loads(body[8:8 + n]).get("__metadata__") or {}


def decode_request(body: bytes):
    """-> (outputs: Tensor | list[str], examples: list)."""
    meta, tensors = _metadata(body), st_load(body)
    examples = json.loads(meta["examples"])
    outputs = json.loads(meta["texts"]) if "texts" in meta else tensors["outputs"]
    if len(outputs) != len(examples):
        raise ValueError(f"{len(outputs)} outputs for {len(examples)} examples")
    return outputs, examples


# ------------------------------------------------------------------------------------------------ server
class _Job:
    def __init__(self, outputs, examples):
        self.outputs, self.examples = outputs, examples
        self.done, self.result, self.error = threading.Event(), None, None

    def key(self):  # requests merge into one reward call only when their outputs stack
        o = self.outputs
        return ("tensor", tuple(o.shape[1:]), o.dtype) if isinstance(o, torch.Tensor) else ("text",)


class RewardServer:
    """Serve `reward` (a reward callable) on host:port (port 0: any free port; see `.url`)."""

    def __init__(self, reward, name: str = "reward", host: str = "127.0.0.1", port: int = 0, max_batch: int = 256,
                 max_wait_ms: float = 10.0, queue_size: int = 64, request_timeout_s: float = 600.0):
        self.reward, self.name = reward, name
        self.max_batch, self.max_wait, self.request_timeout = max_batch, max_wait_ms / 1000, request_timeout_s
        self.queue: queue.Queue[_Job] = queue.Queue(maxsize=queue_size)
        self.requests = self.batches = self.rejected = 0
        self._carry: _Job | None = None
        self._stop = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "RewardServer":
        """Serve in background threads (tests, notebooks); `close()` stops."""
        for fn in (self._work, self.httpd.serve_forever):
            th = threading.Thread(target=fn, daemon=True)
            th.start()
            self._threads.append(th)
        return self

    def serve_forever(self) -> None:
        th = threading.Thread(target=self._work, daemon=True)
        th.start()
        try:
            self.httpd.serve_forever()
        finally:
            self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # one worker: merge queued requests of one kind, score them with one call
    def _next(self, timeout: float):
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        return self.queue.get(timeout=timeout)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._next(0.1)
            except queue.Empty:
                continue
            batch, n, deadline = [first], len(first.examples), time.monotonic() + self.max_wait
            while n < self.max_batch:
                try:
                    job = self._next(max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job.key() != first.key() or n + len(job.examples) > self.max_batch:
                    self._carry = job
                    break
                batch.append(job)
                n += len(job.examples)
            self._score(batch)

    def _score(self, batch: list[_Job]) -> None:
        from mmrl.reward import RewardRunner

        self.batches += 1
        try:
            outs = [j.outputs for j in batch]
            merged = torch.cat(outs) if isinstance(outs[0], torch.Tensor) else [o for x in outs for o in x]
            examples = [e for j in batch for e in j.examples]
            res = RewardRunner._check(self.reward(merged, examples), len(examples))
            start = 0
            for j in batch:
                j.result = {k: v[start:start + len(j.examples)].contiguous() for k, v in res.items()}
                start += len(j.examples)
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            log.warning("reward raised on a batch of %d requests: %s: %s", len(batch), type(e).__name__, e)
            for j in batch:
                j.error = f"{type(e).__name__}: {e}"
        for j in batch:
            j.done.set()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # quiet: one line per request would flood training logs
                log.debug(fmt, *args)

            def _reply(self, code: int, body: bytes, ctype: str = "application/json", headers=()):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path != "/health":
                    return self._reply(404, b'{"error": "GET /health or POST /score"}')
                self._reply(200, json.dumps({"ok": True, "reward": server.name, "queued": server.queue.qsize(),
                                             "requests": server.requests, "batches": server.batches,
                                             "rejected": server.rejected}).encode())

            def do_POST(self):
                if self.path != "/score":
                    return self._reply(404, b'{"error": "POST /score"}')
                try:
                    body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    job = _Job(*decode_request(body))
                except Exception as e:  # noqa: BLE001 - a bad request is the client's error
                    return self._reply(400, json.dumps({"error": f"unreadable request: {e}"}).encode())
                try:
                    server.queue.put_nowait(job)
                except queue.Full:
                    server.rejected += 1
                    return self._reply(503, b'{"error": "queue full"}', headers=[("Retry-After", "1")])
                server.requests += 1
                if not job.done.wait(server.request_timeout):
                    return self._reply(504, b'{"error": "not scored within the server request timeout"}')
                if job.error is not None:
                    return self._reply(500, json.dumps({"error": job.error}).encode())
                self._reply(200, st_save(job.result), "application/octet-stream")

        return Handler


# ------------------------------------------------------------------------------------------------ client
class RemoteReward:
    """A reward served by `mmrl serve-reward`: `(outputs, examples) -> {key: [N]}` over HTTP.

    Each try waits at most timeout_s; connection errors, timeouts, 503 (backpressure) and 504 are retried
    `retries` times with exponential backoff (backoff_s, 2*backoff_s, ...); a 400 or 500 (the reward itself
    raised) is not retried. So a call returns or raises within (retries + 1) * timeout_s + backoff_s *
    (2 ** retries - 1) seconds, never hangs. A failed batch is not re-scored sample by sample
    (per_sample_retry = False): with reward.on_error=skip all its samples are invalid and counted.
    """

    per_sample_retry = False

    def __init__(self, url: str = "http://127.0.0.1:8765", timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s
        self.stats = {"tries": 0, "retries": 0, "busy": 0}

    def __call__(self, outputs, examples) -> dict[str, torch.Tensor]:
        body, last = encode_request(outputs, examples), None
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.stats["tries"] += 1
            req = urllib.request.Request(self.url + "/score", data=body, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return dict(st_load(resp.read()))
            except urllib.error.HTTPError as e:
                msg = e.read().decode(errors="replace")[:500]
                if e.code in (502, 503, 504):
                    self.stats["busy"] += e.code == 503
                    last = f"HTTP {e.code} {msg}"
                    continue
                raise RewardServerError(f"reward server {self.url} answered HTTP {e.code}: {msg}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise RewardServerError(
            f"reward server {self.url} did not answer after {self.retries + 1} tries (last: {last}). Is it running "
            f"(`mmrl serve-reward NAME --port PORT`)? Raise reward.kwargs.timeout_s / retries for a slow model, or "
            f"set reward.on_error=skip to count the batch as failed and go on.")


def serve_main(args) -> int:
    from mmrl.compose import build_reward

    reward = build_reward(args.name, json.loads(args.kwargs))
    server = RewardServer(reward, args.name, args.host, args.port, args.max_batch, args.max_wait_ms, args.queue,
                          args.request_timeout)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the reward server listens on %s: reachable beyond this machine (no authentication)", args.host)
    print(f"serving reward {args.name!r} on {server.url} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
