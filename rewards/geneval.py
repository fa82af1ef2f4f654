"""GenEval (Ghosh et al. 2023, https://arxiv.org/abs/2310.11513) as a reward: object-level correctness of an image
against a prompt's metadata, with an open-vocabulary detector and a CLIP colour classifier from transformers.

Metadata (one row of GenEval's prompts/evaluation_metadata.jsonl; tasks/geneval.py reads and checks it):

    {"tag": "position", "prompt": "a photo of a dog right of a teddy bear",
     "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "exclude": [{"class": ..., "count": ...}]}      # only counting prompts exclude (count + 1 of the class)

GenEval's rules (its evaluation/evaluate_images.py), implemented by `keep_detections` and `judge`:
- detections of a class are kept when score > 0.3 (> 0.9 for counting prompts), best first, at most 16 per class,
  then greedy NMS at IoU `max_overlap` (1.0 = none, GenEval's default: Mask2Former's set predictions have no
  duplicates);
- every include clause needs `count` detections of its class; colour and position are checked on the best
  `count` of them only: colour by CLIP zero-shot over COLORS, position against every object of the clause it
  names (`relative_position`); exclude clauses fail when `count` or more detections of the class are kept;
- an image is correct when every clause holds. GenEval's score is the mean over tags of the per-tag accuracy.

Differences from GenEval's own pipeline (which runs a COCO Mask2Former through mmdet): the detector here is
OWLv2 or Grounding DINO, queried with the example's class names only; boxes are clamped to the image; colour is
classified on the box crop (GenEval composites the segmentation mask on gray first; these detectors have no masks,
which is GenEval's own no-mask path). The score thresholds are GenEval's, calibrated on Mask2Former: OWLv2's
sigmoid scores are lower (a confident box often scores 0.3 - 0.6), so calibrate threshold / counting_threshold on
real images before trusting counting. OWLv2 scores every image patch, so an object yields several boxes: the
reward's default max_overlap is 0.3 (the NMS IoU of transformers' OWLv2 image-guided post-processing), not 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmrl.errors import ConfigError
from tasks.geneval import COLORS, RELATIONS, TAGS, check_metadata

# GenEval's three colour prompts per class; the classifier of a colour is the normalized mean of their embeddings
COLOR_TEMPLATES = ("a photo of a {color} {cls}", "a photo of a {color}-colored {cls}", "a photo of a {color} object")

Box = tuple[float, float, float, float]                  # x0, y0, x1, y1 in pixels, y grows downwards
Detection = tuple[Box, float, "str | None"]              # (box, score, colour or None when not classified)


@dataclass(frozen=True)
class Rules:
    """GenEval's evaluation options and their defaults (evaluate_images.py `--options`)."""

    threshold: float = 0.3            # keep a detection when score > threshold
    counting_threshold: float = 0.9   # ... for prompts tagged "counting"
    max_objects: int = 16             # at most this many detections per class, best first
    max_overlap: float = 1.0          # NMS: drop a detection with IoU >= this with a better one of its class; 1 = off
    position_threshold: float = 0.1   # c of `relative_position`: the dead zone, as a fraction of the summed box sizes


# ------------------------------------------------------------------------------------------------ metadata
def classes_of(metadata: dict) -> list[str]:
    """The distinct class names a prompt's metadata mentions, in order: the detector's queries."""
    return list(dict.fromkeys(c["class"] for c in metadata["include"] + metadata.get("exclude", [])))


# ----------------------------------------------------------------------------------------------------- rules
def box_iou(a: Box, b: Box) -> float:
    """IoU the way GenEval computes it: coordinates are inclusive pixel indices (width = x1 - x0 + 1)."""
    def area(x0, y0, x1, y1):
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def relative_position(a: Box, b: Box, c: float = 0.1) -> set[str]:
    """Where box a is relative to box b: a subset of RELATIONS. The centre offset shrinks toward zero by c times the
    summed box sizes on each axis; a direction holds when its shrunk component exceeds half the offset's length."""
    off = ((a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2)
    size = (abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1]))
    shrunk = [math.copysign(max(abs(o) - c * s, 0.0), o) for o, s in zip(off, size)]
    if all(abs(s) < 1e-3 for s in shrunk):
        return set()
    dx, dy = (s / math.hypot(*off) for s in shrunk)
    return {r for r, holds in zip(RELATIONS, (dx < -0.5, dx > 0.5, dy < -0.5, dy > 0.5)) if holds}


def keep_detections(detections: dict[str, list[Detection]], tag: str, rules: Rules = Rules()
                    ) -> dict[str, list[Detection]]:
    """GenEval's per-class filtering: score threshold (by tag), best first, max_objects, greedy NMS. Classes left
    without detections are dropped. Idempotent, so already filtered detections pass through unchanged."""
    t = rules.counting_threshold if tag == "counting" else rules.threshold
    out = {}
    for cls, dets in detections.items():
        order = sorted((d for d in dets if d[1] > t), key=lambda d: -d[1])[:rules.max_objects]
        kept = []
        while order:
            best = order.pop(0)
            kept.append(best)
            if rules.max_overlap < 1:
                order = [d for d in order if box_iou(best[0], d[0]) < rules.max_overlap]
        if kept:
            out[cls] = kept
    return out


def judge(metadata: dict, detections: dict[str, list[Detection]], rules: Rules = Rules()) -> tuple[bool, str]:
    """GenEval's verdict on one image: (correct, the failed checks joined by "; ", empty when correct).

    metadata: a GenEval row (tasks.geneval.check_metadata). detections: {class: [(box xyxy, score, colour or
    None), ...]}, raw or already filtered (keep_detections runs here). A colour clause needs the colours of its
    class's best `count` detections: None there raises ValueError (the detector adapter must classify them).
    """
    dets = keep_detections(detections, metadata["tag"], rules)
    reasons, groups = [], []
    for i, req in enumerate(metadata["include"]):
        cls, n = req["class"], req["count"]
        found = dets.get(cls, [])[:n]
        ok = len(found) >= n
        if not ok:
            reasons.append(f"expected {cls} >= {n}, found {len(found)}")
        elif "color" in req:
            colors = [d[2] for d in found]
            if None in colors:
                raise ValueError(f"include[{i}] asks a {req['color']} {cls} but its detections carry no colour")
            if colors.count(req["color"]) < n:
                ok = False
                reasons.append(f"expected {n} {req['color']} {cls}, found colours {colors}")
        if ok and "position" in req:
            rel, target = req["position"]
            if groups[target] is None:
                ok = False
                reasons.append(f"no target for {cls} to be {rel}")
            else:
                for obj in found:
                    for other in groups[target]:
                        true_rels = relative_position(obj[0], other[0], rules.position_threshold)
                        if rel not in true_rels:
                            ok = False
                            reasons.append(f"expected {cls} {rel} {metadata['include'][target]['class']}, found "
                                           f"{' and '.join(sorted(true_rels)) or 'no relation'}")
                            break
                    if not ok:
                        break
        groups.append(found if ok else None)
    for req in metadata.get("exclude", []):
        have = len(dets.get(req["class"], []))
        if have >= req["count"]:
            reasons.append(f"expected {req['class']} < {req['count']}, found {have}")
    return not reasons, "; ".join(reasons)


# ----------------------------------------------------------------------------------- the shapes world adapter
def shapes_detections(img: np.ndarray, min_area: int | None = None) -> dict[str, list[Detection]]:
    """The shapes world's detector (rewards/shapes.py) in GenEval's structure: class = shape, score 1.0, colour =
    the palette colour, box = the component's pixel extent (x0, y0, x1 + 1, y1 + 1). img: uint8 [H, W, 3]."""
    from rewards.shapes import _NAMES, _PALETTE, _components, detect, min_area_for

    min_area = min_area_for(img.shape[0]) if min_area is None else min_area
    label = ((img[:, :, None, :].astype(np.float32) - _PALETTE) ** 2).sum(-1).argmin(-1)  # [H, W], as detect() does
    boxes: dict[tuple, list[Box]] = {}
    for ci, name in enumerate(_NAMES):
        for pix in _components(label == ci):
            if len(pix) >= min_area:
                (y0, x0), (y1, x1) = pix.min(0), pix.max(0)
                key = (name, (x0 + x1) / 2, (y0 + y1) / 2, len(pix))
                boxes.setdefault(key, []).append((float(x0), float(y0), float(x1 + 1), float(y1 + 1)))
    out: dict[str, list[Detection]] = {}
    for d in detect(img, min_area):  # largest first; every score is 1, so this is the order judge() keeps
        out.setdefault(d.shape, []).append((boxes[(d.color, d.cx, d.cy, d.area)].pop(), 1.0, d.color))
    return out


def shapes_metadata(spec, prompt: str) -> dict:
    """GenEval metadata for a shapes-world Spec (tasks/shapes.py), built as GenEval's create_prompts.py builds its
    rows: counting excludes count + 1; position names the second object first and relates the first to it."""
    objs = [{"class": o.shape, "count": 1, **({"color": o.color} if o.color else {})} for o in spec.objects]
    row = {"tag": spec.category, "prompt": prompt}
    if spec.category == "counting":
        n = len(spec.objects)
        return {**row, "include": [{"class": objs[0]["class"], "count": n}],
                "exclude": [{"class": objs[0]["class"], "count": n + 1}]}
    if spec.category == "position":
        return {**row, "include": [objs[1], {**objs[0], "position": [spec.relation, 0]}]}
    return {**row, "include": objs}


# ------------------------------------------------------------------------------------------ model adapters
class _OwlV2:
    """OWLv2 (Minderer et al. 2023) through transformers: one query per class ("a photo of a {class}"); each box
    takes its best query; boxes are in the padded square frame OWLv2 sees, so they scale by max(H, W)."""

    def __init__(self, path: str, device: str, query_template: str):
        self.path, self.device, self.template, self.model = path, device, query_template, None

    def __call__(self, images: np.ndarray, classes: list[str], threshold: float) -> list[dict]:
        if self.model is None:
            from transformers import Owlv2ForObjectDetection, Owlv2Processor

            self.processor = Owlv2Processor.from_pretrained(self.path)
            model = Owlv2ForObjectDetection.from_pretrained(self.path, use_safetensors=True)
            self.model = model.to(self.device).eval().requires_grad_(False)  # last: a half-failed load is retried
        queries = [self.template.format(c) for c in classes]
        inputs = self.processor(text=[queries] * len(images), images=list(images), truncation=True,
                                return_tensors="pt")  # OWLv2 reads 16 text tokens
        with torch.no_grad():
            out = self.model(**inputs.to(self.device))
        h, w = images.shape[1:3]
        res = self.processor.image_processor.post_process_object_detection(
            out, threshold=threshold, target_sizes=[(h, w)] * len(images))
        return [_by_class(r["boxes"], r["scores"], r["labels"], classes, w, h) for r in res]


class _GroundingDino:
    """Grounding DINO (Liu et al. 2023) through transformers: the text is "class one. class two."; a box's score
    for a class is its best sigmoid logit over that class's tokens, and the box takes its best class."""

    def __init__(self, path: str, device: str, query_template: str):
        self.path, self.device, self.model = path, device, None

    def __call__(self, images: np.ndarray, classes: list[str], threshold: float) -> list[dict]:
        if self.model is None:
            from transformers import AutoProcessor, GroundingDinoForObjectDetection

            self.processor = AutoProcessor.from_pretrained(self.path)
            model = GroundingDinoForObjectDetection.from_pretrained(self.path, use_safetensors=True)
            self.model = model.to(self.device).eval().requires_grad_(False)  # last: a half-failed load is retried
        names = [c.strip().lower() for c in classes]
        text = ". ".join(names) + "."
        inputs = self.processor(images=list(images), text=[text] * len(images), return_tensors="pt")
        spans = _token_spans(self.processor.tokenizer, text, names, inputs["input_ids"][0])
        with torch.no_grad():
            out = self.model(**inputs.to(self.device))
        probs = out.logits.float().sigmoid().cpu()                                    # [B, Q, T]
        per_class = torch.stack([probs[..., s].amax(-1) for s in spans], -1)          # [B, Q, K]
        scores, labels = per_class.max(-1)                                            # [B, Q]
        h, w = images.shape[1:3]
        cx, cy, bw, bh = out.pred_boxes.float().cpu().unbind(-1)                      # [B, Q] each, relative
        boxes = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], -1)
        keep = scores > threshold
        return [_by_class(boxes[b][keep[b]], scores[b][keep[b]], labels[b][keep[b]], classes, w, h)
                for b in range(len(images))]


def _token_spans(tokenizer, text: str, names: list[str], input_ids: torch.Tensor) -> list[list[int]]:
    """The token positions of each name in `text` (joined by ". "), from the tokenizer's character offsets."""
    enc = tokenizer(text, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == input_ids.tolist(), "the processor tokenized the text differently"
    spans, start = [], 0
    for name in names:
        end = start + len(name)
        span = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a >= start and b <= end]
        if not span:
            raise ValueError(f"class {name!r} has no tokens in the detector's text {text!r} (truncated?)")
        spans.append(span)
        start = end + 2
    return spans


def _by_class(boxes, scores, labels, classes, w, h) -> dict[str, list[tuple[Box, float]]]:
    """{class: [(box clamped to the image, score), ...]} from a detector's kept boxes [M, 4], scores [M], labels [M]."""
    out: dict[str, list] = {}
    for box, s, k in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
        x0, y0, x1, y1 = (min(max(v, 0.0), lim) for v, lim in zip(box, (w, h, w, h)))
        out.setdefault(classes[k], []).append(((x0, y0, x1, y1), float(s)))
    return out


DETECTORS = {"owlv2": _OwlV2, "grounding_dino": _GroundingDino}


class _ClipColors:
    """GenEval's colour classifier: CLIP zero-shot over COLORS (COLOR_TEMPLATES per colour, for the object's
    class) on the box crop, preprocessed as the CLIP image processor asks (short side resize, centre crop)."""

    def __init__(self, path: str, device: str, batch_size: int):
        self.path, self.device, self.batch_size, self.model = path, device, batch_size, None
        self.weights: dict[str, torch.Tensor] = {}  # class -> [C, D] unit colour classifiers

    def _load(self):
        if self.model is None:
            from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            ip = CLIPImageProcessor.from_pretrained(self.path)
            crop = ip.crop_size if isinstance(ip.crop_size, int) else ip.crop_size["height"]
            self.size, self.mean, self.std = crop, ip.image_mean, ip.image_std
            model = CLIPModel.from_pretrained(self.path, use_safetensors=True)
            self.model = model.to(self.device).eval().requires_grad_(False)  # last: a half-failed load is retried
        return self.model

    @torch.no_grad()
    def _classifier(self, cls: str) -> torch.Tensor:
        if cls not in self.weights:
            from rewards.clip_models import _tensor

            m = self._load()
            texts = [t.format(color=c, cls=cls) for c in COLORS for t in COLOR_TEMPLATES]
            tok = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt",
                                 max_length=m.config.text_config.max_position_embeddings)  # 77 for CLIP
            emb = torch.nn.functional.normalize(_tensor(m.get_text_features(**tok.to(self.device))).float(), dim=-1)
            w = emb.view(len(COLORS), len(COLOR_TEMPLATES), -1).mean(1)               # [C, D]
            self.weights[cls] = torch.nn.functional.normalize(w, dim=-1)
        return self.weights[cls]

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, boxes: list[Box], cls: str) -> list[str]:
        """image [3, H, W] in [-1, 1]; one colour name per box."""
        from rewards.clip_models import _tensor, clip_preprocess

        m, w = self._load(), self._classifier(cls)
        h_img, w_img = image.shape[-2:]
        crops = []
        for x0, y0, x1, y1 in boxes:  # PIL's crop rounds the box; at least one pixel
            x0, y0 = min(round(x0), w_img - 1), min(round(y0), h_img - 1)
            x1, y1 = max(round(x1), x0 + 1), max(round(y1), y0 + 1)
            crops.append(clip_preprocess(image[None, :, y0:y1, x0:x1], self.size, self.mean, self.std))
        px = torch.cat(crops).to(self.device)                                         # [M, 3, S, S]
        feats = torch.cat([_tensor(m.get_image_features(pixel_values=px[s:s + self.batch_size]))
                           for s in range(0, len(px), self.batch_size)]).float()
        pred = (torch.nn.functional.normalize(feats, dim=-1) @ w.T).argmax(-1)        # [M]
        return [COLORS[i] for i in pred.tolist()]


class GenEvalReward:
    """`(outputs, examples) -> {"overall": [N], "is/<tag>": [N], "correct/<tag>": [N] for each tag}`.

    outputs: images [N, 3, H, W] in [-1, 1]. examples: dicts holding GenEval metadata ("tag", "include",
    "exclude"?), as tasks/geneval.py makes them (or a .jsonl prompt file of GenEval rows read by task.prompt_file).
    "overall" is GenEval's strict correctness, 1 or 0. "is/<tag>" is 1 where the example has that tag and
    "correct/<tag>" is 1 where it has that tag and is correct, so over any set of samples the accuracy of a tag
    is mean(correct/<tag>) / mean(is/<tag>) (also the "overall" mean of the tag's category in mmrl eval's
    per_category), and GenEval's score is the mean of those accuracies over the tags present (`geneval_score`).

    Args:
      detector_path: a local OWLv2 (Owlv2ForObjectDetection + Owlv2Processor) or Grounding DINO folder
        (GroundingDinoForObjectDetection + its processor); safetensors weights only, no remote code.
      clip_path: a transformers CLIPModel folder (model, tokenizer, CLIPImageProcessor) for colour clauses;
        GenEval uses OpenAI's CLIP ViT-L/14. Needed only when an example asks a colour.
      detector: "owlv2" | "grounding_dino". query_template: OWLv2's text query per class.
      threshold, counting_threshold, max_objects, max_overlap, position_threshold: `Rules` (see the module
        docstring for why max_overlap defaults to 0.3 here).
      tags: the tags whose is/correct keys are returned; an example with another tag raises.
    A sample whose detection raises raises (mmrl's RewardRunner then scores the batch sample by sample and marks
    the failing ones invalid), with the prompt in the message.
    """

    def __init__(self, detector_path: str, clip_path: str | None = None, detector: str = "owlv2",
                 device: str = "cpu", batch_size: int = 8, threshold: float = 0.3, counting_threshold: float = 0.9,
                 max_objects: int = 16, max_overlap: float = 0.3, position_threshold: float = 0.1,
                 query_template: str = "a photo of a {}", tags: tuple[str, ...] | list[str] = TAGS):
        if detector not in DETECTORS:
            raise ConfigError(f"reward.kwargs.detector={detector!r} is not one of {sorted(DETECTORS)}")
        self.rules = Rules(threshold, counting_threshold, max_objects, max_overlap, position_threshold)
        self.detector = DETECTORS[detector](detector_path, device, query_template)
        self.colors = _ClipColors(clip_path, device, batch_size) if clip_path else None
        self.batch_size, self.tags = batch_size, tuple(tags)

    def _metadata(self, examples) -> list[dict]:
        metas = []
        for i, ex in enumerate(examples):
            if not isinstance(ex, dict) or "include" not in ex:
                raise ConfigError(f"example {i} ({ex if isinstance(ex, str) else ex.get('prompt')!r}) has no GenEval "
                                  f"metadata: use task.name=geneval, or a .jsonl prompt file of GenEval rows")
            meta = check_metadata(ex, f"example {i}")
            if meta["tag"] not in self.tags:
                raise ConfigError(f"example {i} has tag {meta['tag']!r}; the reward's tags are {list(self.tags)}")
            if self.colors is None and any("color" in c for c in meta["include"]):
                raise ConfigError(f"example {i} ({meta['prompt']!r}) asks a colour: set reward.kwargs.clip_path to a "
                                  f"CLIPModel folder (GenEval uses OpenAI CLIP ViT-L/14)")
            metas.append(meta)
        return metas

    def detect(self, images: np.ndarray, metas: list[dict]) -> list[dict[str, list[tuple[Box, float]]]]:
        """Raw detections per image; images sharing their queries (a prompt's group) go through in batches."""
        out: list = [None] * len(metas)
        by_query: dict[tuple, list[int]] = {}
        for i, m in enumerate(metas):
            by_query.setdefault((tuple(classes_of(m)), m["tag"] == "counting"), []).append(i)
        for (classes, counting), idx in by_query.items():
            t = self.rules.counting_threshold if counting else self.rules.threshold
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                try:
                    res = self.detector(images[chunk], list(classes), t)
                except Exception as e:
                    raise RuntimeError(f"GenEval detection failed for {metas[chunk[0]]['prompt']!r} "
                                       f"({type(e).__name__}: {e})") from e
                for i, r in zip(chunk, res):
                    out[i] = r
        return out

    def __call__(self, outputs: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        from tasks.shapes import to_uint8

        metas = self._metadata(examples)
        raw = self.detect(to_uint8(outputs), metas)
        correct = []
        for img, meta, det in zip(outputs, metas, raw):
            dets = keep_detections({c: [(b, s, None) for b, s in v] for c, v in det.items()}, meta["tag"], self.rules)
            for req in meta["include"]:  # colour the best `count` of each coloured class, the ones judge() reads
                found = dets.get(req["class"], [])
                if "color" in req and found:
                    n = min(req["count"], len(found))
                    names = self.colors(img.float().cpu(), [d[0] for d in found[:n]], req["class"])
                    dets[req["class"]] = [(b, s, c) for (b, s, _), c in zip(found[:n], names)] + found[n:]
            correct.append(judge(meta, dets, self.rules)[0])
        ok = torch.tensor(correct, dtype=torch.float32)
        out = {"overall": ok}
        for tag in self.tags:
            is_tag = torch.tensor([m["tag"] == tag for m in metas], dtype=torch.float32)
            out[f"is/{tag}"], out[f"correct/{tag}"] = is_tag, is_tag * ok
        return out


def geneval_score(means: dict[str, float]) -> dict[str, float]:
    """{tag: accuracy, ..., "geneval": mean over the tags present} from the means of a GenEvalReward's keys (e.g.
    mmrl eval's results), the way GenEval's summary_scores.py averages: per tag first, then over tags."""
    acc = {k[3:]: means[f"correct/{k[3:]}"] / v for k, v in means.items() if k.startswith("is/") and v > 0}
    return {**acc, "geneval": sum(acc.values()) / len(acc) if acc else float("nan")}
