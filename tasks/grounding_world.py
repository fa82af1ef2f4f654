"""The embedded temporal-grounding world: synthetic videos written as real mp4 files, queries in Charades-STA format.

Each video is FRAMES frames at FPS on a mid-gray canvas (mid-gray = 0 after the vision tower's
normalization; on a dark background the features of a tiny vision tower barely vary, see ENVIRONMENT.md).
2-3 target objects (a colored shape each, unique in its video) are visible over integer-second intervals;
1-2 distractors share a color or a shape with some target; each object owns one quadrant. A query names one target:

    charades_sta_{split}.txt     SYN00042 2.0 5.0##the red circle appears.
    Charades_v1_{split}.csv      id,length,...           (the columns Charades ships, durations in s)
    videos/SYN00042.mp4          H.264 via PyAV

so the real Charades-STA reader (`tasks/grounding_data.py`) loads the world unchanged. Videos are split by
video id: held-out queries are about videos never seen in SFT or GRPO.
"""

from __future__ import annotations

import csv
import json
import os
import random
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageDraw

from tasks.shapes import BACKGROUND, COLORS, SHAPES

FPS, FRAMES, SIZE = 2, 16, 56
DURATION = FRAMES / FPS  # 8.0 s
WORLD_COLORS = ("red", "green", "blue", "yellow")
TEMPLATES = ("the {} appears.", "a {} is shown.", "the {} is visible.")
# Short prompt and answer for the small model (the generic Time-R1-style prompt lives in mmrl/task.py).
PROMPT = "When does this happen: {query} Answer in seconds."
ANSWER = "<think></think><answer>{start:g} to {end:g}</answer>"


def _draw(d: ImageDraw.ImageDraw, shape: str, color: str, cx: int, cy: int, r: int) -> None:
    box, rgb = [cx - r, cy - r, cx + r, cy + r], COLORS[color]
    if shape == "circle":
        d.ellipse(box, fill=rgb)
    elif shape == "square":
        d.rectangle(box, fill=rgb)
    else:
        d.polygon([(cx - r, cy + r), (cx + r, cy + r), (cx, cy - r)], fill=rgb)


def make_video_spec(rng: random.Random) -> list[dict]:
    """Objects of one video: [{"shape", "color", "start", "end", "cx", "cy", "r", "target"}], times in s.

    Each object owns one quadrant of the frame, which is exactly one merged 28 x 28 vision token of
    Qwen-VL (2 x 2 patches of 14 px), so one video token sees one object: at most 4 objects per video."""
    kinds = [(s, c) for s in SHAPES for c in WORLD_COLORS]
    rng.shuffle(kinds)
    n_targets = rng.choice((2, 3))
    targets = kinds[:n_targets]
    # distractors share a shape or a color with a target but are never identical to one
    others = [k for k in kinds[n_targets:] if any(k[0] == t[0] or k[1] == t[1] for t in targets)]
    distractors = others[:rng.choice((1, 2)) if n_targets == 2 else 1]
    half = SIZE // 4
    quadrants = [(half, half), (3 * half, half), (half, 3 * half), (3 * half, 3 * half)]
    rng.shuffle(quadrants)
    objs = []
    for i, (shape, color) in enumerate(targets + distractors):
        length = rng.randint(2, 5)
        start = rng.randint(0, int(DURATION) - length)
        cx, cy = quadrants[i]
        objs.append({"shape": shape, "color": color, "start": float(start), "end": float(start + length),
                     "cx": cx, "cy": cy, "r": 10, "target": i < n_targets})
    return objs


def render_frames(objs: list[dict]) -> np.ndarray:
    """[FRAMES, SIZE, SIZE, 3] uint8; frame k shows the objects whose [start, end) contains k / FPS."""
    frames = []
    for k in range(FRAMES):
        t = k / FPS
        img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
        d = ImageDraw.Draw(img)
        for o in objs:
            if o["start"] <= t < o["end"]:
                _draw(d, o["shape"], o["color"], o["cx"], o["cy"], o["r"])
        frames.append(np.asarray(img))
    return np.stack(frames)


def write_mp4(path: str, frames: np.ndarray, fps: int = FPS) -> None:
    """frames [T, H, W, 3] uint8 -> H.264 mp4 (PyAV), written to a temp name then renamed."""
    import av

    tmp = f"{path}.{os.getpid()}.tmp.mp4"  # per process: two runs may build the same world at once
    with av.open(tmp, "w") as out:
        stream = out.add_stream("libx264", rate=fps, options={"crf": "12", "g": "1"})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    os.replace(tmp, path)


DEFAULT_VIDEOS = {"train": 600, "test": 220}


@contextmanager
def _atomic_write(path: str, **open_kw):
    """Write to a per-process temp name, then rename: two runs may build the same world at once."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", **open_kw) as f:
        yield f
    os.replace(tmp, path)


def build_world(root: str, n_videos: dict[str, int] | None = None, seed: int = 0) -> dict[str, dict]:
    """Write the world under root; a complete world with the same parameters (world.json) is reused.

    n_videos=None reads an existing world as it is (or builds the default 600 / 220 videos). A world already
    under root that was built with other parameters is never overwritten (another run may be reading it): that
    is a ValueError naming both. Several processes may build the same world at once (per-process temp names).
    Returns {split: {"annotations": txt, "durations": csv, "video_dir": dir}} for splits "train" and "test".
    """
    video_dir = os.path.join(root, "videos")
    manifest = os.path.join(root, "world.json")
    old = None
    if os.path.isfile(manifest):
        with open(manifest) as f:
            old = json.load(f)
    if n_videos is None and old is not None:  # read an existing world as it is
        n_videos, seed = old["n_videos"], old["seed"]
    n_videos = n_videos or DEFAULT_VIDEOS
    params = {"n_videos": n_videos, "seed": seed, "fps": FPS, "frames": FRAMES, "size": SIZE, "layout": "quadrants"}
    out = {split: {"annotations": os.path.join(root, f"charades_sta_{split}.txt"),
                   "durations": os.path.join(root, f"Charades_v1_{split}.csv"), "video_dir": video_dir}
           for split in n_videos}
    if old == params:
        return out
    if old is not None:
        raise ValueError(f"{root} holds a grounding world built with {old}, not the requested {params}: pass "
                         f"the same video counts (or none, to read it as it is; task.kwargs.train_videos / "
                         f"test_videos, sft_grounding.py --train-videos / --test-videos), another root, or "
                         f"delete {root}")
    os.makedirs(video_dir, exist_ok=True)
    rng = random.Random(seed)
    for split, n in n_videos.items():
        txt, csv_path = out[split]["annotations"], out[split]["durations"]
        lines, rows = [], []
        for i in range(n):
            vid = f"SYN{split[:2].upper()}{i:05d}"
            objs = make_video_spec(rng)
            path = os.path.join(video_dir, vid + ".mp4")
            if not os.path.isfile(path):
                write_mp4(path, render_frames(objs))
            rows.append({"id": vid, "subject": "synthetic", "scene": "gray", "quality": "7", "relevance": "7",
                         "verified": "Yes", "script": "", "objects": "", "descriptions": "", "actions": "",
                         "length": f"{DURATION:.2f}"})
            for o in objs:
                if o["target"]:
                    q = rng.choice(TEMPLATES).format(f"{o['color']} {o['shape']}")
                    lines.append(f"{vid} {o['start']:.1f} {o['end']:.1f}##{q}")
        with _atomic_write(txt) as f:
            f.write("\n".join(lines) + "\n")
        with _atomic_write(csv_path, newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    with _atomic_write(manifest) as f:  # last: the world is complete
        json.dump(params, f)
    return out
