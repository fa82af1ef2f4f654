"""GenEval's rules (rewards/geneval.py `judge`) against the shapes reward's own rules (rewards/shapes.py `score`)
on rendered shapes scenes, both reading the shapes world's detector, so only the rules differ.

For every tag and three modes, n scenes: a judged prompt J of the tag and a rendered spec R:
  own       R = J (the truth: correct by construction)
  same_tag  R = another spec of J's tag (mostly wrong)
  any_tag   R = any spec of the grammar (mostly wrong; extra objects are common)
Each disagreement is put down to a known rule difference or to "other" (unexplained, which should stay 0):
  extra_objects  GenEval says correct, shapes says wrong, and the image holds more objects than J asks:
                 shapes' strict verdict wants exactly the asked objects, GenEval only excludes for counting.
  position_rule  J is a position prompt and the two agree once the relation is dropped from both: GenEval's
                 relative_position (centre offset shrunk by 0.1 x the summed box sizes, then the direction must
                 exceed half the offset's length) differs from shapes' centre difference > size / 8 px, e.g. on a
                 "knight's move" of the 3 x 3 grid (one cell across, two down), which shapes counts as left/right
                 and GenEval as neither.
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np

from rewards.geneval import judge, shapes_detections, shapes_metadata
from rewards.shapes import detect, score
from tasks.shapes import CATEGORIES, Spec, all_prompts, all_specs, render

MODES = ("own", "same_tag", "any_tag")


def _explain(spec: Spec, meta: dict, img: np.ndarray, geneval: bool, shapes: bool, size: int) -> str:
    dets = detect(img)
    if spec.category == "position":
        bare = {**meta, "include": [{k: v for k, v in c.items() if k != "position"} for c in meta["include"]]}
        if judge(bare, shapes_detections(img))[0] == bool(score(Spec(spec.category, spec.objects), dets, size)[0]):
            return "position_rule"
    if geneval and not shapes and len(dets) > len(spec.objects):
        return "extra_objects"
    return "other"


def agreement(n: int, seed: int = 0, size: int = 36) -> dict:
    """{tag: {"n", "agree", "geneval_correct", "shapes_correct", "by_mode": {mode: {"n", "agree"}},
    "disagree": {"extra_objects", "position_rule", "other"}}, ..., "total": {...}} over n scenes per tag and mode."""
    rng = random.Random(seed)
    specs = all_specs()
    out = {}
    for tag in CATEGORIES:
        judged = [p for p in all_prompts() if p.spec.category == tag]
        same = [s for s in specs if s.category == tag]
        row = {"n": 0, "agree": 0, "geneval_correct": 0, "shapes_correct": 0, "by_mode": {},
               "disagree": {"extra_objects": 0, "position_rule": 0, "other": 0}}
        for mode in MODES:
            agree = 0
            for _ in range(n):
                j = judged[rng.randrange(len(judged))]
                if mode == "own":
                    spec = j.spec
                elif mode == "same_tag":
                    spec = rng.choice([s for s in same if s != j.spec])
                else:
                    spec = rng.choice(specs)
                img = np.asarray(render(spec, size, rng))
                meta = shapes_metadata(j.spec, j.text)
                g = judge(meta, shapes_detections(img))[0]
                s = score(j.spec, detect(img), size)[0] == 1.0
                row["geneval_correct"] += g
                row["shapes_correct"] += s
                agree += g == s
                if g != s:
                    row["disagree"][_explain(j.spec, meta, img, g, s, size)] += 1
            row["by_mode"][mode] = {"n": n, "agree": agree}
            row["n"] += n
            row["agree"] += agree
        out[tag] = row
    out["total"] = {k: sum(out[t][k] for t in CATEGORIES) for k in ("n", "agree", "geneval_correct", "shapes_correct")}
    out["total"]["disagree"] = {k: sum(out[t]["disagree"][k] for t in CATEGORIES) for k in
                                ("extra_objects", "position_rule", "other")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="scenes per tag and mode (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=36, help="image size in px (the shapes world's default, 36)")
    ap.add_argument("--quick", action="store_true", help="8 scenes per tag and mode")
    args = ap.parse_args()
    n = 8 if args.quick else args.n
    res = agreement(n, args.seed, args.size)
    print(f"{'tag':<14} {'n':>5} {'agree':>6} {'own':>5} {'same':>5} {'any':>5}  geneval  shapes  "
          f"extra_objects position_rule other")
    for tag in (*CATEGORIES, "total"):
        r = res[tag]
        modes = [r["by_mode"][m]["agree"] for m in MODES] if tag != "total" else ["", "", ""]
        d = r["disagree"]
        print(f"{tag:<14} {r['n']:>5} {r['agree']:>6} {modes[0]:>5} {modes[1]:>5} {modes[2]:>5}  "
              f"{r['geneval_correct']:>7} {r['shapes_correct']:>7}  {d['extra_objects']:>13} {d['position_rule']:>13} "
              f"{d['other']:>5}")
    print(json.dumps({"n_per_tag_and_mode": n, "seed": args.seed, "size": args.size, "results": res}))


if __name__ == "__main__":
    main()
