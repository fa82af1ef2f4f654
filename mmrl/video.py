"""Video input for video LLMs through qwen-vl-utils, with errors that name the file.

`load_video(path, VideoOptions)` -> (frames float [T, 3, H, W] in 0..255, metadata {"fps", "frames_indices",
"total_num_frames"}): qwen-vl-utils samples frames (fps or nframes, clamped to [4, 768], even count) and
resizes them (min / max / total pixels); the metadata goes to the processor with the frames so the model's
time axis is right (Qwen2.5-VL absolute time, Qwen3-VL timestamps).

qwen-vl-utils falls back to torchvision on ANY backend error, and torchvision's `read_video` no longer exists,
so the only error a user would see is a misleading one (ENVIRONMENT.md). mmrl checks the file first
(missing, empty, no decodable video stream -> `VideoError` naming it) and replaces that fallback with one
that re-raises the configured backend's real error.
"""

from __future__ import annotations

import logging
import os
import threading
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
    frames, meta = fetch_video(opts.element(path), return_video_metadata=True)
    meta = {k: (list(map(int, v)) if k == "frames_indices" else v) for k, v in meta.items()}
    return frames, meta


class VideoCache(BoundedCache):
    """Decoded videos keyed by (path, options): a video is decoded once and reused for generation and every
    log-prob pass (and across iterations while it stays cached)."""

    def get(self, path: str, opts: VideoOptions) -> tuple[torch.Tensor, dict]:
        return super().get((os.path.abspath(path), opts), lambda: load_video(path, opts))
