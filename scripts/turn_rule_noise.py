"""How often a run that does not turn fails a turn rule, from the evaluation's noise alone.

The rule (issue 46's): a run *turns* when its last held-out evaluation is more than MARGIN points below its best
one. Each evaluation of a generator is one noise draw per prompt, so a run that sits on a plateau for its last M
evaluations, each with independent noise of standard deviation SIGMA, still fails the rule with probability

    P(M) = 1 - ∫ φ(z) Φ(z + MARGIN / SIGMA)^(M - 1) dz

(it holds when the M - 1 other evaluations all lie below the last one plus MARGIN; φ, Φ are the standard normal
density and distribution). Over S seeds at least one fails with 1 - (1 - P)^S. K noise draws per evaluation
(`log.eval_draws`, `mmrl eval --draws`) divide SIGMA by sqrt(K). SIGMA can be given, or pooled from checkpoints
scored more than once (`--scores "43.7,41.7,40.7;40.3,36.7,41.3"`: each group is one checkpoint's scores under
different noise seeds).

    python scripts/turn_rule_noise.py --sigma 2.2
    python scripts/turn_rule_noise.py --scores "41.9,40.5,41.1;34.1,36.1,37.9" --plateau 3 5 7 --draws 1 3

Prints a table, then one JSON object on the last line: {"sigma", "margin", "seeds", "rows": [{"plateau", "draws",
"p_seed", "p_any_seed"}]}. It is exact numerical integration, so there is no quick mode: it runs in a second.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def pooled_sd(groups: list[list[float]]) -> float:
    """Standard deviation within groups (each group: one checkpoint scored under several noise seeds), pooled over
    the groups with their degrees of freedom."""
    ss = sum(sum((x - sum(g) / len(g)) ** 2 for x in g) for g in groups)
    dof = sum(len(g) - 1 for g in groups)
    if dof < 1:
        raise SystemExit("--scores needs at least one group of two or more scores (groups split by ';')")
    return math.sqrt(ss / dof)


def p_fail(plateau: int, margin: float, sigma: float) -> float:
    """Chance that the last of `plateau` i.i.d. N(mu, sigma^2) evaluations is more than `margin` below their max."""
    if plateau < 2:
        return 0.0
    z = torch.linspace(-12.0, 12.0, 48_001, dtype=torch.float64)
    density = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    held = torch.trapezoid(density * torch.special.ndtr(z + margin / sigma) ** (plateau - 1), z)
    return float(1.0 - held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sigma", type=float, help="s.d. of one evaluation (points), e.g. the binomial 2.2 at 40%% of 504")
    src.add_argument("--scores", help="checkpoints scored under several noise seeds: 'a,b,c;d,e,f' (points)")
    ap.add_argument("--margin", type=float, default=3.0, help="points below the best at which a run turns")
    ap.add_argument("--plateau", type=int, nargs="+", default=[3, 5, 7, 10], help="evaluations on the plateau")
    ap.add_argument("--draws", type=int, nargs="+", default=[1, 3], help="noise draws per evaluation")
    ap.add_argument("--seeds", type=int, default=3, help="seeds that must all hold")
    args = ap.parse_args()
    groups = [[float(x) for x in g.split(",")] for g in args.scores.split(";")] if args.scores else []
    sigma = pooled_sd(groups) if groups else args.sigma
    if not sigma > 0 or args.margin < 0 or min(args.draws) < 1:
        raise SystemExit("--sigma must be > 0, --margin >= 0 and --draws >= 1")
    rows = []
    print(f"one evaluation's s.d. {sigma:.2f} points, turn = last more than {args.margin:g} below the best")
    print(f"{'plateau':>8} {'draws':>6} {'P(a seed fails)':>16} {f'P(any of {args.seeds} fails)':>20}")
    for k in args.draws:
        for m in args.plateau:
            p = p_fail(m, args.margin, sigma / math.sqrt(k))
            rows.append({"plateau": m, "draws": k, "p_seed": round(p, 4), "p_any_seed": round(1 - (1 - p) ** args.seeds, 4)})
            print(f"{m:>8} {k:>6} {p:>16.3f} {rows[-1]['p_any_seed']:>20.3f}")
    print(json.dumps({"sigma": round(sigma, 4), "margin": args.margin, "seeds": args.seeds, "rows": rows}))


if __name__ == "__main__":
    main()
