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

from mmrl.errors import ConfigError
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


# Out-of-distribution splits of the `ood` world, fixed before any run (docs/worlds.md). Training and the
# in-distribution test split never contain a NOVEL (shape, color) at all; the OOD test splits change one thing:
#   long     16 s videos (32 frames at the same 2 fps): twice any training duration
#   novel    every target is a NOVEL combination (its shape and its color are each seen in training, never together)
#   crowded  1 target and 3 distractors (training has 1-2 distractors and 2-3 targets)
NOVEL = (("circle", "yellow"), ("square", "blue"), ("triangle", "red"))
OOD_SPLITS = {"long": {"duration": 2 * DURATION}, "novel": {"novel": True}, "crowded": {"targets": 1, "distractors": 3}}
OOD_VIDEOS = {"train": 600, "test": 220, "long": 220, "novel": 220, "crowded": 520}  # >= 500 queries per test split


def make_video_spec(rng: random.Random, duration: float = DURATION, exclude: tuple = (), novel: bool = False,
                    targets: int | None = None, distractors: int | None = None) -> list[dict]:
    """Objects of one video: [{"shape", "color", "start", "end", "cx", "cy", "r", "target"}], times in s.

    Each object owns one quadrant of the frame, which is exactly one merged 28 x 28 vision token of
    Qwen-VL (2 x 2 patches of 14 px), so one video token sees one object: at most 4 objects per video.
    exclude: (shape, color) never drawn; novel: the targets are NOVEL combinations (2-3), the distractors not;
    targets / distractors: fixed counts instead of 2-3 targets and 1-2 distractors."""
    kinds = [(s, c) for s in SHAPES for c in WORLD_COLORS]
    rng.shuffle(kinds)
    kinds = [k for k in kinds if k not in exclude]
    n_targets = targets or rng.choice((2, 3))
    pool = [k for k in kinds if (k in NOVEL) == novel] if novel else kinds
    chosen = pool[:n_targets]
    rest = [k for k in kinds if k not in chosen and (not novel or k not in NOVEL)]
    # distractors share a shape or a color with a target but are never identical to one
    others = [k for k in rest if any(k[0] == t[0] or k[1] == t[1] for t in chosen)]
    n_distractors = distractors or (rng.choice((1, 2)) if n_targets == 2 else 1)
    extra = others[:n_distractors]
    half = SIZE // 4
    quadrants = [(half, half), (3 * half, half), (half, 3 * half), (3 * half, 3 * half)]
    rng.shuffle(quadrants)
    objs = []
    for i, (shape, color) in enumerate(chosen + extra):
        length = rng.randint(2, 5)
        start = rng.randint(0, int(duration) - length)
        cx, cy = quadrants[i]
        objs.append({"shape": shape, "color": color, "start": float(start), "end": float(start + length),
                     "cx": cx, "cy": cy, "r": 10, "target": i < n_targets})
    return objs


def render_frames(objs: list[dict], n_frames: int = FRAMES) -> np.ndarray:
    """[n_frames, SIZE, SIZE, 3] uint8; frame k shows the objects whose [start, end) contains k / FPS."""
    frames = []
    for k in range(n_frames):
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


def build_world(root: str, n_videos: dict[str, int] | None = None, seed: int = 0, ood: bool = False) -> dict[str, dict]:
    """Write the world under root; a complete world with the same parameters (world.json) is reused.

    n_videos=None reads an existing world as it is (or builds the default 600 / 220 videos). A world already
    under root that was built with other parameters is never overwritten (another run may be reading it): that
    is a ValueError naming both. Several processes may build the same world at once (per-process temp names).
    ood=True builds the out-of-distribution world: NOVEL combinations excluded from train and test, and the
    test splits of OOD_SPLITS (long, novel, crowded) beside them (default counts OOD_VIDEOS).
    Returns {split: {"annotations": txt, "durations": csv, "video_dir": dir}} for every split.
    """
    video_dir = os.path.join(root, "videos")
    manifest = os.path.join(root, "world.json")
    old = None
    if os.path.isfile(manifest):
        with open(manifest) as f:
            old = json.load(f)
    if n_videos is None and old is not None and old.get("ood", False) == ood:  # read an existing world as it is
        n_videos, seed = old["n_videos"], old["seed"]
    n_videos = n_videos or (OOD_VIDEOS if ood else DEFAULT_VIDEOS)
    params = {"n_videos": n_videos, "seed": seed, "fps": FPS, "frames": FRAMES, "size": SIZE, "layout": "quadrants"}
    if ood:
        params["ood"] = True
    out = {split: {"annotations": os.path.join(root, f"charades_sta_{split}.txt"),
                   "durations": os.path.join(root, f"Charades_v1_{split}.csv"), "video_dir": video_dir}
           for split in n_videos}
    if old == params:
        return out
    if old is not None:
        raise ConfigError(f"{root} holds a grounding world built with {old}, not the requested {params}: pass "
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
            kw = dict(OOD_SPLITS.get(split, {}), exclude=() if split == "novel" else NOVEL) if ood else {}
            duration = kw.get("duration", DURATION)
            objs = make_video_spec(rng, **kw)
            path = os.path.join(video_dir, vid + ".mp4")
            if not os.path.isfile(path):
                write_mp4(path, render_frames(objs, int(duration * FPS)))
            rows.append({"id": vid, "subject": "synthetic", "scene": "gray", "quality": "7", "relevance": "7",
                         "verified": "Yes", "script": "", "objects": "", "descriptions": "", "actions": "",
                         "length": f"{duration:.2f}"})
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
