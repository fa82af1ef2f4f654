"""Video temporal grounding as a task: a dataset in its distributed format (task.name=grounding) or the embedded
synthetic-video world (task.name=grounding_world), and the blind constant-answer baseline printed beside every
model, scored in the benchmark metric (tasks/grounding_metrics.py: tIoU -> R1@{0.3, 0.5, 0.7} (>=) and mIoU). A
policy's greedy answers are scored by rewards/grounding.py `evaluate`."""

from __future__ import annotations

import json
import random

from mmrl.errors import ConfigError
from tasks.grounding_data import load_dataset
from tasks.grounding_metrics import grounding_metrics, multi_window_iou
from tasks.grounding_world import ANSWER, DEFAULT_VIDEOS, OOD_SPLITS, OOD_VIDEOS, PROMPT, build_world


def constant_baseline(fit: list[dict], examples: list[dict], step: float = 0.05) -> dict:
    """The best blind answer: one window [a, b] x duration (a, b on a `step` grid) chosen for mIoU on `fit`
    (the training queries), scored on `examples`. A model that does not beat it has not looked at the video."""
    grid = [round(i * step, 6) for i in range(int(round(1 / step)) + 1)]

    def miou(a, b, rows):
        return sum(multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in rows) / len(rows)

    a, b = max(((a, b) for a in grid for b in grid if b > a), key=lambda ab: miou(*ab, fit))
    ious = [multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in examples]
    return {"window_fraction": [a, b], **{k: round(v, 4) for k, v in grounding_metrics(ious).items()}}


# ------------------------------------------------------------------ training-label regimes (docs/results.md,
# "Where RL should beat supervised training"): one function each, used by the task (so GRPO's prompts, its
# TempSamp-R1 injection and its reward) and by scripts/sft_grounding.py alike, so SFT and GRPO cannot disagree.
NOISE_GRID = 0.1  # noisy spans are written to the annotation files' precision (s)


def select_label_pool(examples: list[dict], size: int, seed: int = 0) -> list[dict]:
    """The labelled pool of the scarce-labels regime: `size` training queries drawn with `seed` from the queries'
    ids (the choice does not depend on their order), returned in their original order."""
    if size < 1 or size > len(examples):
        raise ConfigError(f"label_pool={size}: need 1 <= label_pool <= {len(examples)} (the training queries)")
    qids = sorted(ex["qid"] for ex in examples)
    if len(set(qids)) != len(qids):
        raise ConfigError("label_pool needs unique query ids (qid)")
    keep = set(random.Random(f"label_pool/{seed}").sample(qids, size))
    return [ex for ex in examples if ex["qid"] in keep]


def _snap(t: float) -> float:
    return round(round(t / NOISE_GRID) * NOISE_GRID, 6)


def shifted_span(window, duration: float, rng: random.Random) -> list[float]:
    """[s, e] moved by a uniform 20-50% of the duration, earlier or later (a direction that keeps some of the span
    inside the video; there is always one), clipped to [0, duration], on the NOISE_GRID."""
    s, e = map(float, window)
    d = rng.uniform(0.2, 0.5) * duration
    signs = [sign for sign in (-1, 1) if min(e + sign * d, duration) - max(s + sign * d, 0.0) >= NOISE_GRID]
    sign = rng.choice(signs or [1 if s + e < duration else -1])
    a, b = _snap(max(s + sign * d, 0.0)), _snap(min(e + sign * d, duration))
    return [a, b] if b > a else [max(0.0, _snap(b - NOISE_GRID)), b]


def random_span(duration: float, rng: random.Random) -> list[float]:
    """Two uniform points of [0, duration], sorted, on the NOISE_GRID (redrawn until they differ)."""
    while True:
        a, b = sorted(_snap(rng.uniform(0.0, duration)) for _ in range(2))
        if b > a:
            return [a, b]


def apply_label_noise(examples: list[dict], fraction: float, seed: int = 0) -> list[dict]:
    """The noisy-labels regime: round(fraction x n) queries (drawn with `seed` from the queries' ids) get a wrong
    span, the first half of them (rounded up) shifted (`shifted_span`), the rest drawn at random (`random_span`).
    Returns new example dicts (the inputs are not touched); a changed one has "windows" = [its noisy span] and
    "label_noise" = "shifted" | "random". Only training queries are ever given to it."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"label_noise must be in [0, 1], got {fraction}")
    qids = sorted(ex["qid"] for ex in examples)
    rng = random.Random(f"label_noise/{seed}")
    chosen = rng.sample(qids, round(fraction * len(qids)))
    n_shift = (len(chosen) + 1) // 2
    kind = {q: "shifted" if i < n_shift else "random" for i, q in enumerate(chosen)}
    by_qid = {ex["qid"]: ex for ex in examples}
    noisy = {}
    for q in sorted(chosen):  # in id order: the spans drawn do not depend on the examples' order
        ex = by_qid[q]
        dur = float(ex["duration"])
        span = shifted_span(ex["windows"][0], dur, rng) if kind[q] == "shifted" else random_span(dur, rng)
        noisy[q] = {**ex, "windows": [span], "label_noise": kind[q]}
    return [noisy.get(ex["qid"], ex) for ex in examples]


def read_query_ids(path: str) -> list[str]:
    """A JSON list of query ids (the difficulty filter's output: scripts/grounding_regimes.py --difficulty-filter)."""
    with open(path) as f:
        ids = json.load(f)
    if not isinstance(ids, list) or not all(isinstance(q, str) for q in ids):
        raise ConfigError(f"{path}: expected a JSON list of query ids (strings)")
    return ids


def keep_queries(examples: list[dict], ids: list[str], where: str = "difficulty_filter") -> list[dict]:
    """The examples whose qid is in ids; an id that names no training query is an error (another world?)."""
    have = {ex["qid"] for ex in examples}
    unknown = [q for q in ids if q not in have]
    if unknown:
        raise ConfigError(f"{where}: {len(unknown)} of {len(ids)} query ids are not training queries of this task "
                          f"(e.g. {unknown[:3]}): was it written for another world or label pool?")
    keep = set(ids)
    out = [ex for ex in examples if ex["qid"] in keep]
    if not out:
        raise ConfigError(f"{where}: keeps no training query")
    return out


GROUNDING_PROMPT = ('To accurately pinpoint the event "{query}" in the video, determine the precise time period of '
                    'the event. Output your thought process within the <think> </think> tags, then give the start '
                    'and end times (in seconds) within the <answer> </answer> tags, e.g. <answer>12.5 to 17.0</answer>.')


# the injected ground truth must earn the whole reward the prompt asks for: the format reward (rewards/grounding.py
# format_ok) requires a <think> block before the answer, so the reference answer has an empty one
GROUNDING_ANSWER = "<think></think><answer> {start:.2f} to {end:.2f} </answer>"


class GroundingTask:
    """Video temporal grounding on a dataset in its distributed format (tasks/grounding_data.py).

    task.kwargs: format (charades_sta | activitynet | qvhighlights), annotations, video_dir, durations
    (Charades csv), eval_annotations / eval_video_dir / eval_durations (default: the training ones),
    prompt (template with {query} and {duration}), answer (template with {start} and {end}: the reference
    answer TempSamp-R1 injects), on_error / missing_video (raise | skip), text_first (the query before the
    video in the user turn; default: the video first, as Qwen-VL's grounding recipes do).
    Examples: {"prompt", "video", "duration", "windows", "qid", "query", "text_first"}.

    Training-label regimes (docs/results.md, "Where RL should beat supervised training"), applied once when the
    task loads, to the training queries only (held-out queries keep their true spans), in this order:
    label_noise / noise_seed: that fraction of the training spans replaced (`apply_label_noise`: half shifted by
    20-50% of the duration, half random), so SFT targets, TempSamp-R1's injected answers and the reward all read
    the same noisy spans; label_pool / pool_seed: train on a seeded subset of that many queries only
    (`select_label_pool`); difficulty_filter: a JSON list of query ids to keep (scripts/grounding_regimes.py
    --difficulty-filter writes it). scripts/sft_grounding.py passes the same kwargs, so its SFT sees the same data.
    """

    samples_ahead = True  # sample() reads its rng alone: the trainer draws the next batch early to decode its videos

    def __init__(self, cfg, format: str = "charades_sta", annotations: str = "", video_dir: str = "",
                 durations: str | None = None, eval_annotations: str | None = None, eval_video_dir: str | None = None,
                 eval_durations: str | None = None, prompt: str = GROUNDING_PROMPT,
                 answer: str = GROUNDING_ANSWER, on_error: str = "raise",
                 missing_video: str = "raise", text_first: bool = False, label_pool: int | None = None,
                 pool_seed: int = 0, label_noise: float = 0.0, noise_seed: int = 0,
                 difficulty_filter: str | None = None):
        if not annotations:
            raise ConfigError("task.kwargs.annotations is required for task.name=grounding (the annotation file)")
        self.prompt_template, self.answer_template, self.text_first = prompt, answer, text_first
        self.train = self._examples(load_dataset(format, annotations, video_dir, durations, on_error, missing_video))
        ev = load_dataset(format, eval_annotations or annotations, eval_video_dir or video_dir,
                          eval_durations or durations, on_error, missing_video)
        self.eval = self._examples([e for e in ev if e["windows"]])[:cfg.eval_prompts]
        if not self.train:
            raise ConfigError(f"{annotations}: no usable training queries")
        self.train_clean = self.train  # every training query with its true span (the blind baseline fits on it)
        self.label_info = {"train_queries": len(self.train)}
        if label_noise:
            self.train = apply_label_noise(self.train, label_noise, noise_seed)
            self.label_info.update(label_noise=label_noise, noise_seed=noise_seed,
                                   noisy=sum("label_noise" in ex for ex in self.train))
        if label_pool is not None:
            self.train = select_label_pool(self.train, label_pool, pool_seed)
            self.label_info.update(label_pool=label_pool, pool_seed=pool_seed)
        if difficulty_filter:
            self.train = keep_queries(self.train, read_query_ids(difficulty_filter),
                                      f"difficulty_filter={difficulty_filter}")
            self.label_info.update(difficulty_filter=difficulty_filter)
        self.label_info["used_queries"] = len(self.train)

    def _examples(self, rows):
        return [{**r, "prompt": self.prompt_template.format(query=r["query"], duration=r["duration"]),
                 "text_first": self.text_first} for r in rows if r["windows"]]

    def sample(self, n, rng):
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def eval_examples(self):
        return self.eval

    def baselines(self) -> dict[str, dict]:
        """The blind constant answer fitted on the training queries, scored on the held-out ones (and on each
        held-out category, e.g. the OOD splits), in the reward's keys as mmrl eval prints the models."""
        def metrics(rows):
            m = constant_baseline(self.train_clean, rows)
            return {"iou": m["mIoU"], **{f"r1@{t}": m[f"R1@{t}"] / 100 for t in (0.3, 0.5, 0.7)}, "n": len(rows)}

        cats = sorted({e["category"] for e in self.eval if e.get("category")})
        per_cat = {c: metrics([e for e in self.eval if e.get("category") == c]) for c in cats}
        fit = constant_baseline(self.train_clean, self.eval)["window_fraction"]
        return {"constant answer": {**metrics(self.eval), "window_fraction": fit, "per_category": per_cat}}

    def reference_output(self, ex) -> str:
        """The ground-truth answer text (TempSamp-R1 off-policy injection; SFT targets)."""
        s, e = ex["windows"][0]
        return self.answer_template.format(start=s, end=e)


class GroundingWorldTask(GroundingTask):
    """The embedded synthetic-video world (tasks/grounding_world.py), built under task.kwargs.root on first use
    and read back through the Charades-STA reader. kwargs: root, train_videos, test_videos (none: an existing
    world's counts, else 600 / 220; other counts than an existing world's are an error), and GroundingTask's
    prompt / answer / text_first and training-label regimes (label_pool, label_noise, difficulty_filter). The query comes before the video by default: then the distance in M-RoPE
    positions from the answer to each video token does not depend on the query's length, which a 1 M-parameter
    model reading time off those distances cannot otherwise compensate for. ood=True: the out-of-distribution
    world (tasks/grounding_world.py: NOVEL combinations never in training; held-out = the in-distribution test
    split and the long / novel / crowded splits, each example's category its split)."""

    writes_files = True  # renders its videos on first use (rank 0 first): `mmrl validate` does not build it

    def __init__(self, cfg, root: str = "runs/grounding_world", train_videos: int | None = None,
                 test_videos: int | None = None, ood: bool = False, **kwargs):
        defaults = OOD_VIDEOS if ood else DEFAULT_VIDEOS
        sizes = None if train_videos is None and test_videos is None else \
            {**defaults, "train": train_videos or defaults["train"], "test": test_videos or defaults["test"]}
        w = build_world(root, sizes, ood=ood)
        kwargs.setdefault("prompt", PROMPT)
        kwargs.setdefault("answer", ANSWER)
        kwargs.setdefault("text_first", True)
        super().__init__(cfg, "charades_sta", w["train"]["annotations"], w["train"]["video_dir"],
                         w["train"]["durations"], w["test"]["annotations"], w["test"]["video_dir"],
                         w["test"]["durations"], **kwargs)
        if ood:  # held-out = the in-distribution test split and every OOD split, each its own category
            self.eval = [{**e, "category": "id"} for e in self.eval]
            on_error, missing = kwargs.get("on_error", "raise"), kwargs.get("missing_video", "raise")
            for split in OOD_SPLITS:
                rows = load_dataset("charades_sta", w[split]["annotations"], w[split]["video_dir"],
                                    w[split]["durations"], on_error, missing)
                self.eval += [{**e, "category": split} for e in self._examples(rows)[:cfg.eval_prompts]]
