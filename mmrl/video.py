"""Video input for video LLMs through qwen-vl-utils, with errors that name the file.

`load_video(path, VideoOptions)` -> (frames float [T, 3, H, W] in 0..255, metadata {"fps", "frames_indices",
"total_num_frames"}): qwen-vl-utils samples frames (fps or nframes, clamped to [4, 768], even count) and
resizes them (min / max / total pixels, sides multiples of 2 x the model's patch size: `image_patch_size`, 16 for
Qwen3-VL); the metadata goes to the processor with the frames so the model's time axis is right (Qwen2.5-VL
absolute time, Qwen3-VL timestamps). `reference_video_tokens` is the token count qwen-vl-utils' sizing gives.

`VideoCache.prefetch` decodes videos in a background thread pool ahead of need (the next batch's, while this one
samples); `get` then waits for that decode, and a decode error surfaces there, exactly as a synchronous one.

qwen-vl-utils falls back to torchvision on ANY backend error, and torchvision's `read_video` no longer exists,
so the only error a user would see is a misleading one (ENVIRONMENT.md). mmrl checks the file first
(missing, empty, no decodable video stream -> `VideoError` naming it) and replaces that fallback with one
that re-raises the configured backend's real error.
"""

from __future__ import annotations

import logging
import os
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mmrl.cache import BoundedCache
from mmrl.errors import ConfigError, UserError

BACKENDS = ("decord", "torchcodec")
_last_error = threading.local()


class VideoError(UserError, RuntimeError):
    """A video of the user's data that cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class VideoOptions:
    backend: str = "decord"         # decord | torchcodec (torchcodec needs FFmpeg's shared libraries)
    fps: float | None = 2.0         # frames sampled per second (ignored when nframes is set)
    nframes: int | None = None      # exact frame count (even; qwen-vl-utils rounds)
    min_pixels: int | None = None   # per frame; None = qwen-vl-utils' default
    max_pixels: int | None = None
    total_pixels: int | None = None  # budget over all frames
    image_patch_size: int = 14      # the vision patch (Qwen2/2.5-VL 14, Qwen3-VL 16): frame sides are 2x multiples

    def element(self, path: str) -> dict:
        """The qwen-vl-utils / chat-message video element for `path`."""
        ele = {"type": "video", "video": "file://" + os.path.abspath(path)}
        if self.nframes is not None:
            ele["nframes"] = self.nframes
        elif self.fps is not None:
            ele["fps"] = self.fps
        for k in ("min_pixels", "max_pixels", "total_pixels"):
            if getattr(self, k) is not None:
                ele[k] = getattr(self, k)
        return ele


def check_video_file(path: str) -> None:
    """Raise VideoError unless `path` is a non-empty file with a decodable video stream (PyAV probe)."""
    if not os.path.isfile(path):
        raise VideoError(f"video file {path!r} does not exist (check the dataset's video_dir, or set "
                         f"missing_video=skip to count and skip such queries)")
    if os.path.getsize(path) == 0:
        raise VideoError(f"video file {path!r} is empty (re-download or re-encode it)")
    try:
        import av

        with av.open(path) as c:
            if not c.streams.video:
                raise VideoError(f"{path!r} has no video stream")
            next(c.decode(video=0))
    except VideoError:
        raise
    except Exception as e:  # noqa: BLE001 - any container / codec failure
        raise VideoError(f"video file {path!r} is corrupt or not a video ({type(e).__name__}: {e}); "
                         f"re-encode it (e.g. ffmpeg -i in -c:v libx264 out.mp4)") from e


def _install_backend(backend: str) -> None:
    """Make qwen-vl-utils use `backend` and re-raise its real error instead of falling back to torchvision."""
    from qwen_vl_utils import vision_process as vp

    if backend not in BACKENDS:
        raise ConfigError(f"unknown video backend {backend!r}; valid: {BACKENDS}")
    vp.logger.setLevel(max(vp.logger.level, logging.WARNING))  # it logs one INFO line per decoded video
    vp.FORCE_QWENVL_VIDEO_READER = backend
    readers = vp.VIDEO_READER_BACKENDS
    if not getattr(readers, "_mmrl", False):
        originals = dict(readers)

        def recording(name):
            def read(ele):
                try:
                    return originals[name](ele)
                except Exception as e:
                    _last_error.value = (name, e)
                    raise
            return read

        def no_fallback(ele):
            name, e = getattr(_last_error, "value", ("?", None))
            raise VideoError(f"the {name} backend could not decode {ele.get('video')!r}: {type(e).__name__}: {e}") from e

        patched = _Readers({k: recording(k) for k in originals if k != "torchvision"})
        patched["torchvision"] = no_fallback
        vp.VIDEO_READER_BACKENDS = patched


class _Readers(dict):
    _mmrl = True


def load_video(path: str, opts: VideoOptions = VideoOptions()) -> tuple[torch.Tensor, dict]:
    """(frames [T, 3, H, W] float 0..255, metadata) of the video at `path`; raises VideoError naming it."""
    from qwen_vl_utils import fetch_video

    check_video_file(path)
    _install_backend(opts.backend)
    frames, meta = fetch_video(opts.element(path), image_patch_size=opts.image_patch_size, return_video_metadata=True)
    meta = {k: (list(map(int, v)) if k == "frames_indices" else v) for k, v in meta.items()}
    return frames, meta


def reference_video_tokens(frames: torch.Tensor, merge_size: int = 2, temporal_patch_size: int = 2,
                           image_patch_size: int = 14) -> int:
    """Vision tokens of frames [T, 3, H, W] as qwen-vl-utils sized them (the reference preprocessing, whose processor
    call then keeps that size): T / temporal_patch_size x (H / patch) x (W / patch) / merge_size^2."""
    t, _, h, w = frames.shape
    return math.ceil(t / temporal_patch_size) * (h // image_patch_size) * (w // image_patch_size) // merge_size**2


class VideoCache(BoundedCache):
    """Decoded videos keyed by (path, options): a video is decoded once and reused for generation and every
    log-prob pass (and across iterations while it stays cached). workers > 0: `prefetch` decodes in that many
    background threads (decord and PyAV decode outside the GIL), so decoding overlaps the training thread."""

    def __init__(self, capacity: int = 256, max_bytes: float = 2 * 2**30, workers: int = 0):
        super().__init__(capacity, max_bytes)
        self.workers, self._pool, self._pending = workers, None, {}  # key -> Future of load_video

    def get(self, path: str, opts: VideoOptions) -> tuple[torch.Tensor, dict]:
        key = (os.path.abspath(path), opts)
        pending = self._pending.pop(key, None)
        if pending is not None and key not in self:
            return super().get(key, pending.result)  # waits; re-raises the decode's VideoError here
        return super().get(key, lambda: load_video(path, opts))

    def prefetch(self, paths: list[str], opts: VideoOptions) -> None:
        """Start decoding `paths` in the background (no-op without workers, or for a video cached or in flight).
        Finished decodes nobody asked for yet move into the LRU (bounded); failed ones are dropped and fail
        again, synchronously, when `get` asks for them."""
        if not self.workers:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, "video")
        _install_backend(opts.backend)  # patch qwen-vl-utils once, here, not racing in the workers
        for key, fut in list(self._pending.items()):
            if fut.done():
                del self._pending[key]
                if fut.exception() is None:
                    super().get(key, fut.result)
        for path in paths:
            key = (os.path.abspath(path), opts)
            if key not in self and key not in self._pending:
                self._pending[key] = self._pool.submit(load_video, path, opts)

    def close(self) -> None:
        """Stop the background decodes (queued ones are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._pending = None, {}
