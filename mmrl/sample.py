"""`mmrl sample CONFIG [CKPT ...] [--prompts FILE_OR_TEXT ...] [--n N] [--seed S] [--out DIR] [--base]
[key=value ...]`: look at what models generate, side by side, with their rewards.

Each model generates deterministically (`policy.evaluate`, as `mmrl eval` does: ODE samples, greedy answers;
prompt i uses seed S + i, so every model sees the same noise), and the config's evaluation reward
(`reward.eval_name`, else `reward.name`) scores every sample. A CKPT is a run folder (log.out_dir: its latest
checkpoints/iter-N), a trainer checkpoint, its policy/ folder, or a model folder. `--base` puts the config's
base model (model.path) first; without any CKPT the base is sampled alone. Prompts: .txt files (one per line,
'#' comments), .jsonl files (a "prompt" field; the other fields go to the reward as they do from a task), or
literal texts; default: N of the task's held-out examples, taken in turn from each category.

Written into --out (default runs/samples/<config stem>):
    <model>/<i>.png          image i (flow policies on images)
    <model>/<i>.gif, .mp4    video i (the mp4 when PyAV is installed)
    samples.jsonl            one line per sample: model, prompt, seed, reward components (or reward_error),
                             file (token policies: completion)
    contact_sheet.png        one row per prompt, one column per model; under each image (or strip of up to 8
                             frames) its prompt and reward
A reward that raises leaves the samples written; its error is printed once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from mmrl import compose
from mmrl.checkpoint import latest
from mmrl.errors import ConfigError, MissingFile
from mmrl.eval import policy_folder
from mmrl.evaluation import EVAL_BATCH
from mmrl.metrics import video_strips

BATCH = EVAL_BATCH  # prompts per evaluate call (mmrl eval's chunk size)
CELL_H = 180      # contact sheet: images are scaled (integer factor, nearest) to about this height ...
MAX_W = 1024      # ... and at most this width
TEXT_W = 192      # cells are at least this wide, for the text
PAD = 4           # pixels around each cell's image and text
PROMPT_LINES = 3  # a longer prompt is cut with "..."
FONT_SIZE = 12    # of Pillow's default font


def run(args) -> int:
    """The command (args from mmrl/cli.py's `sample` parser; the CLI appends key=value items it did not place to
    args.overrides). A usage error raises ValueError / FileNotFoundError naming the fix, before any model loads."""
    items = list(args.rest) + list(args.prompts or [])
    cfg = compose.load_config(args.config, list(args.overrides) + [x for x in items if is_override(x)])
    ckpts = [resolve_checkpoint(x) for x in args.rest if not is_override(x)]
    columns = ([("base", None)] if args.base or not ckpts else []) + list(zip(labels(ckpts), ckpts))
    check_base_model(cfg, [path for _, path in columns])
    prompts = [x for x in args.prompts or [] if not is_override(x)]
    examples = read_prompts(prompts) if prompts else stratified(compose.build_task(cfg.task).eval_examples(), args.n)
    if not examples:
        raise ConfigError("no prompts: give --prompts FILE_OR_TEXT, or --n > 0")
    out = args.out or os.path.join("runs", "samples", os.path.splitext(os.path.basename(args.config))[0])
    sample(cfg, columns, examples, out, args.seed, args.fps)
    return 0


# ------------------------------------------------------------------------------------------- arguments
def is_override(item: str) -> bool:
    """`section.key=value` (not a path that exists, not a prompt with spaces before its '=')."""
    return re.fullmatch(r"[A-Za-z_][\w.]*=.*", item) is not None and not os.path.exists(item)


def resolve_checkpoint(path: str) -> str:
    """A run folder means its latest checkpoints/iter-N; a checkpoint, policy or model folder stays as given."""
    if not os.path.exists(path):
        raise MissingFile(f"checkpoint {path!r} does not exist: give a run folder (log.out_dir), "
                          f"runs/NAME/checkpoints/iter-N, its policy/ folder, or a model folder")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = latest(os.path.join(path, "checkpoints"))
        if found is None:
            raise MissingFile(f"run folder {path!r} has no checkpoints/iter-N yet: train longer than "
                              f"log.save_every iterations, or give a checkpoint folder")
        return found
    if policy_folder(path) is None and not any(os.path.isfile(os.path.join(path, f))
                                               for f in ("model_index.json", "config.json")):
        raise MissingFile(f"{path!r} is neither a checkpoint (no mmrl_policy.json in it or in its policy/) "
                          f"nor a model folder (no model_index.json or config.json)")
    return path


def labels(paths: list[str]) -> list[str]:
    """Short unique column names: runs/NAME/checkpoints/iter-N[/policy] -> NAME-iter-N, else the folder name."""
    out = []
    for path in paths:
        parts = os.path.abspath(path).split(os.sep)
        parts = parts[:-1] if parts[-1] == "policy" else parts
        name = f"{parts[-3]}-{parts[-1]}" if len(parts) > 2 and parts[-2] == "checkpoints" else parts[-1]
        out.append(name if name not in out + ["base"] else f"{name}-{len(out) + 1}")
    return out


def check_base_model(cfg, paths: list[str | None]) -> None:
    """model.path must exist when the base is sampled or a checkpoint's weights load into it."""
    if any(p is None or policy_folder(p) for p in paths) and not os.path.isdir(cfg.model.path):
        raise MissingFile(f"the config's model.path={cfg.model.path!r} does not exist: give the base model "
                          f"folder as model.path=FOLDER (a diffusers pipeline, an mmrl pixel model or a "
                          f"transformers model)")


def read_prompts(items: list[str]) -> list[dict]:
    """Examples {"prompt": ...} from .txt / .jsonl files (a .jsonl row keeps its other fields) and literal texts."""
    examples = []
    for item in items:
        if not (item.endswith((".txt", ".jsonl")) or os.path.isfile(item)):
            examples.append({"prompt": item})
            continue
        if not os.path.isfile(item):
            raise MissingFile(f"prompts file {item!r} does not exist")
        with open(item, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
        rows = ([json.loads(ln) for ln in lines if ln] if item.endswith(".jsonl") else
                [{"prompt": ln} for ln in lines if ln and not ln.startswith("#")])
        if not rows:
            raise ConfigError(f"prompts file {item!r} has no prompts: one per line ('#' lines are comments), or "
                              f"one JSON object with a \"prompt\" field per line (.jsonl)")
        bad = [i + 1 for i, r in enumerate(rows) if not isinstance(r, dict) or "prompt" not in r]
        if bad:
            raise ConfigError(f"prompts file {item!r}: rows {bad[:5]} have no \"prompt\" field")
        examples += rows
    return examples


# ------------------------------------------------------------------------------------------- sampling
def policies(cfg, columns: list[tuple[str, str | None]]):
    """(label, policy) per column, in order (the base, path None, first). As in `mmrl eval`, one policy object
    serves the base and every checkpoint (each loads its weights into it); a model folder is its own model."""
    policy = None
    for label, path in columns:
        folder = policy_folder(path) if path else None
        if path and folder is None:
            yield label, compose.build_policy(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path)))
            continue
        policy = policy or compose.build_policy(cfg)
        if folder:
            policy.load_trainable_state(folder)
        yield label, policy


class Scorer:
    """The config's evaluation reward. A batch it fails on is scored sample by sample; a sample it still fails
    on (or every sample, when the reward cannot be built) stays unscored, and the first error is printed once."""

    def __init__(self, cfg):
        name = cfg.reward.eval_name or cfg.reward.name
        kwargs = cfg.reward.eval_kwargs if cfg.reward.eval_name else cfg.reward.kwargs
        self.error, self.fn = None, None
        try:
            self.fn = compose.build_reward(name, kwargs, "reward.eval")
        except Exception as e:  # noqa: BLE001 - the samples are worth writing anyway
            self._fail(e)

    def __call__(self, outputs, examples: list[dict]) -> list[dict]:
        """Per sample {key: value} (reward keys, overall first), or {"reward_error": message}."""
        try:
            return self._score(outputs, examples)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            if len(examples) == 1:
                return [{"reward_error": f"{type(e).__name__}: {e}"}]
            return [row for i in range(len(examples)) for row in self(outputs[i:i + 1], examples[i:i + 1])]

    def _score(self, outputs, examples: list[dict]) -> list[dict]:
        if self.fn is None:
            raise RuntimeError(f"the reward could not be built ({self.error})")
        r = {k: torch.as_tensor(v).detach().float().cpu().reshape(-1) for k, v in self.fn(outputs, examples).items()}
        keys = ["overall"] + [k for k in r if k != "overall"]
        return [{k: round(float(r[k][i]), 4) for k in keys} for i in range(len(examples))]

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            print(f"mmrl sample: the reward failed; those samples are written unscored: {type(e).__name__}: {e}",
                  file=sys.stderr)
            self.error = f"{type(e).__name__}: {e}"


def sample(cfg, columns: list[tuple[str, str | None]], examples: list[dict], out: str, seed: int = 0,
           fps: int = 8) -> dict:
    """Generate, score and write everything (module docstring); returns {what: path} of what was written."""
    scorer = Scorer(cfg)
    rows, cells = [], {}  # samples.jsonl lines; (prompt i, column) -> contact sheet image [h, w, 3] uint8
    bar = tqdm(total=len(columns) * len(examples), desc="sample", unit="sample", disable=not cfg.log.progress)
    for col, (label, policy) in enumerate(policies(cfg, columns)):
        for start in range(0, len(examples), BATCH):
            chunk = examples[start:start + BATCH]
            outputs = policy.evaluate(chunk, seed + start)  # [n, 3, H, W] | [n, 3, F, H, W] in [-1, 1] | n texts
            rewards = scorer(outputs, chunk)
            for j, (ex, reward) in enumerate(zip(chunk, rewards)):
                i = start + j
                row = {"model": label, "prompt": ex["prompt"], "seed": seed + i, **reward}
                if isinstance(outputs, torch.Tensor):
                    row.update(write_media(outputs[j], out, f"{label}/{i}", fps))
                    cells[i, col] = to_uint8(video_strips(outputs[j:j + 1])[0] if outputs.dim() == 5 else outputs[j])
                else:
                    row["completion"] = outputs[j]
                rows.append(row)
            bar.update(len(chunk))
    bar.close()
    written = {"samples": os.path.join(out, "samples.jsonl")}
    os.makedirs(out, exist_ok=True)
    with open(written["samples"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if cells:
        written["contact_sheet"] = os.path.join(out, "contact_sheet.png")
        n, cols = len(examples), range(len(columns))  # rows holds column c's sample i at c * n + i
        contact_sheet([[cells[i, c] for c in cols] for i in range(n)],
                      [[caption(rows[c * n + i]) for c in cols] for i in range(n)],
                      [label for label, _ in columns]).save(written["contact_sheet"])
    report(rows, [(label, path or cfg.model.path) for label, path in columns], len(examples), out, written)
    return written


def stratified(examples: list[dict], n: int) -> list[dict]:
    """n held-out examples taken round-robin over their categories (each category's in the task's order), so a small
    draw covers every category alike; examples without categories: the first n."""
    by: dict = {}
    for ex in examples:
        by.setdefault(ex.get("category"), []).append(ex)
    queues, out = [list(v) for v in by.values()], []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error) of xs."""
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs)) ** 0.5


def report(rows: list[dict], columns: list[tuple[str, str]], n: int, out: str, written: dict) -> None:
    """Where everything went, each model's mean reward with its standard error, and each model's difference from the
    first column (paired over prompts), or a note that the draw is too small to tell them apart."""
    print(f"{len(rows)} samples: {len(columns)} model(s) x {n} prompts in {out}/")
    scores = {}
    for label, path in columns:
        mine = [r.get("overall") for r in rows if r["model"] == label]
        scored = [x for x in mine if x is not None]
        scores[label] = mine
        mean = "mean overall reward {:.4f} ± {:.4f}".format(*mean_se(scored)) if scored else "unscored"
        mean += f" ({len(scored)} of {len(mine)} scored)" if scored and len(scored) < len(mine) else ""
        print(f"  {label}/  ({path}): {mean}")
    first = columns[0][0]
    for label, _ in columns[1:]:
        pairs = [b - a for a, b in zip(scores[first], scores[label]) if a is not None and b is not None]
        if len(pairs) < 2:
            continue
        d, se = mean_se(pairs)
        tell = "a difference beyond 2 standard errors" if abs(d) > 2 * se else \
            "too few prompts to tell them apart: more with --n"
        print(f"  {label} - {first}: {d:+.4f} ± {se:.4f} (paired over {len(pairs)} prompts): {tell}")
    files = sorted({os.path.splitext(r[k])[1] for r in rows for k in ("file", "mp4") if k in r})
    if files:
        print(f"  files: {out}/<model>/<i>{{{','.join(files)}}}")
    for what, path in written.items():
        print(f"  {what}: {path}")


# ------------------------------------------------------------------------------------------- files
def to_uint8(x: torch.Tensor) -> np.ndarray:
    """[3, ..., H, W] in [-1, 1] -> uint8 [..., H, W, 3]."""
    return ((x.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(0, -1).numpy()


def write_media(x: torch.Tensor, out: str, name: str, fps: int) -> dict:
    """A sample, an image [3, H, W] or a video [3, F, H, W] in [-1, 1], as out/name.png or out/name.gif (and
    out/name.mp4 with PyAV); their paths relative to out: {"file": png or gif, "mp4": mp4}."""
    os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
    if x.dim() == 3:
        Image.fromarray(to_uint8(x)).save(os.path.join(out, f"{name}.png"))
        return {"file": f"{name}.png"}
    frames = to_uint8(x)                                              # [F, H, W, 3]
    images = [Image.fromarray(f) for f in frames]
    images[0].save(os.path.join(out, f"{name}.gif"), save_all=True, append_images=images[1:],
                   duration=round(1000 / fps), loop=0)
    written = {"file": f"{name}.gif"}
    if write_mp4(os.path.join(out, f"{name}.mp4"), frames, fps):
        written["mp4"] = f"{name}.mp4"
    return written


def write_mp4(path: str, frames: np.ndarray, fps: int) -> bool:
    """frames [F, H, W, 3] uint8 -> an H.264 mp4 (PyAV, mmrl's `video` extra); False without PyAV."""
    try:
        import av
    except ImportError:
        return False
    h, w = frames.shape[1:3]
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")  # yuv420p: even sides
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "12"})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return True


# ------------------------------------------------------------------------------------------- contact sheet
def caption(row: dict) -> tuple[str, str]:
    """(prompt, reward) under a sample in the contact sheet: "overall=0.50 strict=0.00 ..." or the error."""
    scores = " ".join(f"{k}={v:.2f}" for k, v in row.items() if isinstance(v, float))
    return row["prompt"], scores or "reward: error"


def fit(img: np.ndarray) -> Image.Image:
    """An image [h, w, 3] scaled to about CELL_H high and at most MAX_W wide: up by an integer factor (nearest:
    pixels stay sharp squares), or down."""
    h, w = img.shape[:2]
    s = min(CELL_H / h, MAX_W / w)
    im = Image.fromarray(img)
    if s >= 1:
        return im.resize((w * int(s), h * int(s)), Image.NEAREST)
    return im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.LANCZOS)


def font() -> tuple[ImageFont.ImageFont, int]:
    """Pillow's default font and its line height in pixels."""
    f = ImageFont.load_default(FONT_SIZE)
    return f, f.getbbox("Ag")[3] + 2


def contact_sheet(images: list[list[np.ndarray]], captions: list[list[tuple[str, str]]],
                  columns: list[str]) -> Image.Image:
    """images[row][col] [h, w, 3] uint8, each fitted into a cell_w x cell_h cell above its captions[row][col]
    (prompt in black, reward in blue), under one header line naming the columns:
    the sheet is (cols * cell_w) x (header + rows * cell_h), header = line + PAD,
    cell_w = max(image width, TEXT_W) + 2 PAD."""
    f, line = font()
    char = f.getlength("abcdefghijklmnopqrstuvwxyz") / 26                # mean character width
    tiles = [[fit(im) for im in row] for row in images]
    img_w, img_h = max(t.width for r in tiles for t in r), max(t.height for r in tiles for t in r)
    cell_w, header = max(img_w, TEXT_W) + 2 * PAD, line + PAD

    def wrap(text: str) -> list[str]:
        return textwrap.wrap(text, int((cell_w - 2 * PAD) // char)) or [""]

    texts = [[[(t, "black") for t in _cut(wrap(p), PROMPT_LINES)] + [(t, (20, 70, 170)) for t in wrap(r)]
              for p, r in row] for row in captions]                     # [rows][cols][lines] (text, color)
    cell_h = img_h + 3 * PAD + line * max(len(t) for r in texts for t in r)
    sheet = Image.new("RGB", (len(columns) * cell_w, header + len(images) * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for c, name in enumerate(columns):
        draw.text((c * cell_w + PAD, PAD // 2), _cut(wrap(name), 1)[0], fill="black", font=f)
    for r, row in enumerate(tiles):
        top = header + r * cell_h
        draw.line([(0, top), (sheet.width, top)], fill=(200, 200, 200))
        for c, tile in enumerate(row):
            x, y = c * cell_w + PAD, top + PAD
            sheet.paste(tile, (x, y))
            for k, (text, color) in enumerate(texts[r][c]):
                draw.text((x, y + img_h + PAD + k * line), text, fill=color, font=f)
    return sheet


def _cut(lines: list[str], k: int) -> list[str]:
    """At most k lines, the last one ending in '...' when some were cut."""
    return lines if len(lines) <= k else lines[:k - 1] + [lines[k - 1][:-3] + "..."]
