"""Video inputs at the reference's cost and decoded ahead of need; video VAE decodes batched within a memory bound.

- A video prompt costs the vision tokens qwen-vl-utils' sizing gives (its per-frame pixel cap, the model's patch):
  Qwen2.5-VL and Qwen3-VL processors at their published checkpoints' video sizes, several sizes and lengths.
- `VideoCache.prefetch` (background decoding) gives the frames a synchronous decode gives, in any order, and a
  broken video fails at `get` as it does synchronously.
- A Wan VAE decodes several rows per call, as many as the memory budget admits, equal to one row at a time.
"""

import os
import time

import numpy as np
import pytest
import torch

from mmrl.video import VideoCache, VideoError, VideoOptions, load_video, reference_video_tokens

# (frames, height, width) at 8 fps: 2, 5 and 3 s, landscape, 4:3 VGA, portrait
SIZES = [(16, 240, 320), (40, 480, 640), (24, 360, 200)]


def write_video(path: str, frames: int, height: int, width: int, fps: int = 8, seed: int = 0) -> str:
    import av

    rng = np.random.default_rng(seed)
    with av.open(path, "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            for p in s.encode(av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return [write_video(str(d / f"v{t}_{h}x{w}.mp4"), t, h, w, seed=i) for i, (t, h, w) in enumerate(SIZES)]


def published_processor(kind: str):
    """The tiny test processor's tokenizer with the video processor of the published checkpoint (its sizes)."""
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    from mmrl.models.qwen_vl import build_processor, build_tokenizer

    proc = build_processor(kind, build_tokenizer(["a video"]))
    proc.video_processor = (Qwen3VLVideoProcessor(do_sample_frames=False,
                                                  size={"longest_edge": 25165824, "shortest_edge": 4096})
                            if kind == "qwen3_vl" else Qwen2VLVideoProcessor(do_sample_frames=False))
    return proc


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_video_tokens_equal_qwen_vl_utils(kind, videos, caplog):
    from qwen_vl_utils import fetch_video

    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.models.qwen_vl import build_model
    from mmrl.policy.token import TokenPolicy

    proc = published_processor(kind)
    pol = TokenPolicy(model=build_model(kind, proc.tokenizer), processor=proc, sampler_cfg=SamplerConfig(),
                      lora_cfg=LoraConfig(), reference="none")
    patch = 16 if kind == "qwen3_vl" else 14
    assert pol.video_opts.image_patch_size == patch
    pad = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for path in videos:
        ref_frames = fetch_video({"type": "video", "video": "file://" + path, "fps": 2.0}, image_patch_size=patch)
        ref = reference_video_tokens(ref_frames, image_patch_size=patch)
        enc = pol.encode_prompt({"prompt": "what happens?", "video": path})
        assert int((enc["input_ids"] == pad).sum()) == ref, (kind, path)
        assert int(enc["video_grid_thw"].prod()) // 4 == ref
    assert "per-frame pixel cap" not in caplog.text  # the processor applies the reference cap: no warning


def test_video_tokens_are_counted_for_the_logs(videos):
    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.models.qwen_vl import build_model
    from mmrl.policy.token import TokenPolicy

    proc = published_processor("qwen2_5_vl")
    pol = TokenPolicy(model=build_model("qwen2_5_vl", proc.tokenizer), processor=proc,
                      sampler_cfg=SamplerConfig(max_new_tokens=2), lora_cfg=LoraConfig(), reference="none")
    pol.sample([{"prompt": "a", "video": videos[0]}, {"prompt": "b", "video": videos[2]}], 2,
               torch.Generator().manual_seed(0))
    want = [int(pol.encode_prompt({"prompt": p, "video": v})["video_grid_thw"].prod()) // 4
            for p, v in (("a", videos[0]), ("b", videos[2]))]
    assert pol.rollout_counts() == {"video_tokens": want} and pol.rollout_counts() == {"video_tokens": []}


def test_prefetch_equals_synchronous_decoding(videos, tmp_path):
    opts = VideoOptions(max_pixels=64 * 64, min_pixels=28 * 28)
    sync = [load_video(p, opts) for p in videos]
    cache = VideoCache(16, 2**30, workers=2)
    try:
        cache.prefetch(videos[::-1], opts)           # started in another order than asked for
        for p, (frames, meta) in zip(videos, sync):
            got, got_meta = cache.get(p, opts)
            assert torch.equal(got, frames) and got_meta == meta
        assert not cache._pending
        bad = tmp_path / "broken.mp4"
        bad.write_bytes(b"\x00not a video" * 50)
        cache.prefetch([str(bad), str(tmp_path / "missing.mp4")], opts)
        with pytest.raises(VideoError, match="broken.mp4.*corrupt"):
            cache.get(str(bad), opts)
        with pytest.raises(VideoError, match="missing.mp4.*does not exist"):
            cache.get(str(tmp_path / "missing.mp4"), opts)
    finally:
        cache.close()


def test_prefetch_overlaps_the_training_thread(videos):
    """Decoding the next batch in the background while the training thread computes: the wait at `get` is shorter
    than a synchronous decode."""
    opts = VideoOptions(fps=4.0)
    t0 = time.perf_counter()
    for p in videos:
        load_video(p, opts)
    sync = time.perf_counter() - t0
    cache = VideoCache(16, 2**30, workers=1)
    try:
        cache.prefetch(videos, opts)
        time.sleep(1.5 * sync)                        # the rollout of the current batch
        t0 = time.perf_counter()
        for p in videos:
            cache.get(p, opts)
        waited = time.perf_counter() - t0
    finally:
        cache.close()
    assert waited < 0.5 * sync, (waited, sync)


def test_collector_prefetches_the_next_batch_of_a_task_that_samples_ahead():
    import random

    from mmrl.rollout.collect import Collector

    class Task:
        samples_ahead = True

        def sample(self, n, rng):
            return [{"prompt": "p", "video": f"v{rng.randrange(100)}.mp4"} for _ in range(n)]

    class Policy:
        def __init__(self):
            self.asked = []

        def prefetch(self, examples):
            self.asked += [ex["video"] for ex in examples]

    class Dist:
        def share(self, n):
            return range(n)

    from mmrl.seeds import derive_seed

    train = type("T", (), {"prompts_per_iter": 3, "iterations": 5, "seed": 11})()
    cfg = type("Cfg", (), {"train": train, "reward": type("R", (), {"workers": 0})()})
    pol, task = Policy(), Task()
    col = Collector(cfg, pol, task, None, Dist(), None)
    col.collect = lambda rng, gen: (None, None, None, {})
    col(random.Random(0), None, 2)                     # iteration 2 prefetches what iteration 3 will draw
    assert pol.asked == [ex["video"] for ex in task.sample(3, random.Random(derive_seed(11, "iteration", 3)))]
    pol.asked = []
    col(random.Random(0), None, 4)                     # the last iteration: nothing ahead
    Task.samples_ahead = False
    col(random.Random(0), None, 1)                     # a task whose sample() may keep state: never drawn early
    assert pol.asked == []


# --------------------------------------------------------------------------------------- batched VAE decode
def tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                            latents_std=[1.0] * 4).eval()


def test_video_vae_decodes_several_rows_per_call_within_the_budget():
    from mmrl.models.decode_batch import decode_peak, decode_rows, row_bytes, rows_per_call
    from mmrl.models.families.common import wan_vae_decoder

    vae = tiny_wan_vae()
    decode = wan_vae_decoder(vae)
    z = torch.randn(6, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))     # [N, C, F', H, W]
    calls = []
    counted = lambda x: calls.append(len(x)) or decode(x)                          # noqa: E731
    counted.vae, counted.costs = vae, {}
    with torch.no_grad():
        one = torch.cat([decode(z[i:i + 1]) for i in range(len(z))])               # [N, 3, F, H, W]
        fixed, per_row = row_bytes(vae, tuple(z.shape[1:]))
        budget = fixed + 4 * per_row                                               # room for 4 rows
        from mmrl.models import decode_batch

        free, decode_batch.free_bytes = decode_batch.free_bytes, lambda device: budget / decode_batch.MEMORY_FRACTION
        try:
            batched = decode_rows(counted, z, 1)
        finally:
            decode_batch.free_bytes = free
        peak4 = decode_peak(vae, z[:4].to(vae.dtype))[0]
    assert calls == [4, 2] and rows_per_call(fixed, per_row, budget, 6) == 4
    assert peak4 <= budget * 1.05                                                  # the estimate bounds the real peak
    assert (batched - one).abs().max().item() < 1e-5
