"""What shows the architecture, counted (docs/architecture.md): comparisons against a policy kind's name and against a
train.parallel value outside the packages that own them (mmrl/policy/, mmrl/parallel/), the longest class and
function of mmrl/ (ast-measured), and mmrl/'s top level. One JSON object on the last line.

    .venv/bin/python scripts/architecture_counts.py [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re

NAME = r"""["'](flow|token|janus|vlm)["']"""
KIND = re.compile(rf"""(==|!=|\bin\b|\bnot in\b)\s*\(?\s*{NAME}|{NAME}\s*(==|!=)""")
PARALLEL = re.compile(r"""parallel\s*(==|!=|\bin\b|\bnot in\b)\s*\(?\s*["'A-Z]""")
OWNERS = ("mmrl/policy/", "mmrl/parallel/")


def counts(root: str) -> dict:
    kind, parallel, longest_fn, longest_cls = [], [], (0, ""), (0, "")
    for d, _, files in os.walk(os.path.join(root, "mmrl")):
        for f in sorted(x for x in files if x.endswith(".py")):
            path = os.path.join(d, f)
            rel, src = os.path.relpath(path, root), open(path).read()
            if not rel.startswith(OWNERS):
                for i, line in enumerate(src.splitlines(), 1):
                    kind += [f"{rel}:{i}"] if KIND.search(line) else []
                    parallel += [f"{rel}:{i}"] if PARALLEL.search(line) else []
            for node in ast.walk(ast.parse(src)):
                n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > longest_fn[0]:
                    longest_fn = (n, f"{rel}:{node.name}")
                if isinstance(node, ast.ClassDef) and n > longest_cls[0]:
                    longest_cls = (n, f"{rel}:{node.name}")
    top = sorted(os.listdir(os.path.join(root, "mmrl")))
    return {"policy_kind_comparisons": len(kind), "where_kind": kind, "parallel_checks": len(parallel),
            "where_parallel": parallel, "longest_function": longest_fn, "longest_class": longest_cls,
            "top_level": [x for x in top if x != "__pycache__"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the repository root (default: this checkout)")
    c = counts(p.parse_args().root)
    print(f"policy-kind name comparisons outside {', '.join(OWNERS)}: {c['policy_kind_comparisons']}")
    print(f"train.parallel value checks outside them: {c['parallel_checks']}")
    print(f"longest function: {c['longest_function'][1]} ({c['longest_function'][0]} lines); "
          f"longest class: {c['longest_class'][1]} ({c['longest_class'][0]} lines)")
    print(json.dumps(c))


if __name__ == "__main__":
    main()
