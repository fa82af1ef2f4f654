"""Video temporal grounding as a task: a dataset in its distributed format (task.name=grounding) or the embedded
synthetic-video world (task.name=grounding_world); the benchmark metric (greedy answers scored by tIoU ->
R1@{0.3, 0.5, 0.7} (>=) and mIoU, unparseable answers counted as 0) and the blind constant-answer baseline
printed beside every model."""

from __future__ import annotations

from mmrl.evaluation import evaluate_outputs
from rewards.grounding import GroundingReward, grounding_metrics, multi_window_iou
from tasks.grounding_data import load_dataset
from tasks.grounding_world import ANSWER, DEFAULT_VIDEOS, OOD_SPLITS, OOD_VIDEOS, PROMPT, build_world


def evaluate(policy, examples: list[dict], batch_size: int = 32, progress: bool = True) -> dict:
    """{"mIoU", "R1@0.3", "R1@0.5", "R1@0.7" (percent), "parsed", "format", "n"} of greedy answers."""
    res = evaluate_outputs(policy.evaluate, examples, GroundingReward(), seed=0, batch_size=batch_size,
                           progress=progress)
    out = {"mIoU": res["iou"], **{f"R1@{m}": round(100 * res[f"r1@{m}"], 2) for m in (0.3, 0.5, 0.7)},
           "parsed": res["parsed"], "format": res["format"], "n": res["n"]}
    return out


def constant_baseline(fit: list[dict], examples: list[dict], step: float = 0.05) -> dict:
    """The best blind answer: one window [a, b] x duration (a, b on a `step` grid) chosen for mIoU on `fit`
    (the training queries), scored on `examples`. A model that does not beat it has not looked at the video."""
    grid = [round(i * step, 6) for i in range(int(round(1 / step)) + 1)]

    def miou(a, b, rows):
        return sum(multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in rows) / len(rows)

    a, b = max(((a, b) for a in grid for b in grid if b > a), key=lambda ab: miou(*ab, fit))
    ious = [multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in examples]
    return {"window_fraction": [a, b], **{k: round(v, 4) for k, v in grounding_metrics(ious).items()}}


GROUNDING_PROMPT = ('To accurately pinpoint the event "{query}" in the video, determine the precise time period of '
                    'the event. Output your thought process within the <think> </think> tags, then give the start '
                    'and end times (in seconds) within the <answer> </answer> tags, e.g. <answer>12.5 to 17.0</answer>.')


class GroundingTask:
    """Video temporal grounding on a dataset in its distributed format (tasks/grounding_data.py).

    task.kwargs: format (charades_sta | activitynet | qvhighlights), annotations, video_dir, durations
    (Charades csv), eval_annotations / eval_video_dir / eval_durations (default: the training ones),
    prompt (template with {query} and {duration}), answer (template with {start} and {end}: the reference
    answer TempSamp-R1 injects), on_error / missing_video (raise | skip), text_first (the query before the
    video in the user turn; default: the video first, as Qwen-VL's grounding recipes do).
    Examples: {"prompt", "video", "duration", "windows", "qid", "query", "text_first"}.
    """

    def __init__(self, cfg, format: str = "charades_sta", annotations: str = "", video_dir: str = "",
                 durations: str | None = None, eval_annotations: str | None = None, eval_video_dir: str | None = None,
                 eval_durations: str | None = None, prompt: str = GROUNDING_PROMPT,
                 answer: str = "<answer> {start:.2f} to {end:.2f} </answer>", on_error: str = "raise",
                 missing_video: str = "raise", text_first: bool = False):
        if not annotations:
            raise ValueError("task.kwargs.annotations is required for task.name=grounding (the annotation file)")
        self.prompt_template, self.answer_template, self.text_first = prompt, answer, text_first
        self.train = self._examples(load_dataset(format, annotations, video_dir, durations, on_error, missing_video))
        ev = load_dataset(format, eval_annotations or annotations, eval_video_dir or video_dir,
                          eval_durations or durations, on_error, missing_video)
        self.eval = self._examples([e for e in ev if e["windows"]])[:cfg.eval_prompts]
        if not self.train:
            raise ValueError(f"{annotations}: no usable training queries")

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
            m = constant_baseline(self.train, rows)
            return {"iou": m["mIoU"], **{f"r1@{t}": m[f"R1@{t}"] / 100 for t in (0.3, 0.5, 0.7)}, "n": len(rows)}

        cats = sorted({e["category"] for e in self.eval if e.get("category")})
        per_cat = {c: metrics([e for e in self.eval if e.get("category") == c]) for c in cats}
        fit = constant_baseline(self.train, self.eval)["window_fraction"]
        return {"constant answer": {**metrics(self.eval), "window_fraction": fit, "per_category": per_cat}}

    def reference_output(self, ex) -> str:
        """The ground-truth answer text (TempSamp-R1 off-policy injection; SFT targets)."""
        s, e = ex["windows"][0]
        return self.answer_template.format(start=s, end=e)


class GroundingWorldTask(GroundingTask):
    """The embedded synthetic-video world (tasks/grounding_world.py), built under task.kwargs.root on first use
    and read back through the Charades-STA reader. kwargs: root, train_videos, test_videos (none: an existing
    world's counts, else 600 / 220; other counts than an existing world's are an error), and GroundingTask's
    prompt / answer / text_first. The query comes before the video by default: then the distance in M-RoPE
    positions from the answer to each video token does not depend on the query's length, which a 1 M-parameter
    model reading time off those distances cannot otherwise compensate for. ood=True: the out-of-distribution
    world (tasks/grounding_world.py: NOVEL combinations never in training; held-out = the in-distribution test
    split and the long / novel / crowded splits, each example's category its split)."""

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
