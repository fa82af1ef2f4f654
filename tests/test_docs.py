"""The docs build with mkdocs --strict (broken links and anchors fail), the README stays a README, and every
path the README's map names exists."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("pymdownx")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "extending" / "index.html").is_file()


def test_readme_is_short_and_its_map_is_true():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 250
    for cmd in ("bash scripts/setup.sh && .venv/bin/mmrl train configs/t2i/shapes_grpo.yaml",
                "bash scripts/setup.sh && .venv/bin/python -m pytest -q"):
        assert cmd in text
    m = text[text.index("## Repository map"):]
    paths = {p for cell in re.findall(r"^\| (.+?) \|", m, re.M) for p in re.findall(r"`([^`]+)`", cell)}
    assert len(paths) > 20
    assert [p for p in paths if not os.path.exists(os.path.join(ROOT, p))] == []


def test_the_code_cites_only_docs_that_exist():
    cited = set()
    for pkg in ("mmrl", "rewards", "tasks", "scripts", "benchmarks"):
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in (f for f in files if f.endswith(".py")):
                cited |= set(re.findall(r"docs/[\w/.-]+\.md", open(os.path.join(d, f)).read()))
    assert "docs/algorithms.md" in cited
    assert [c for c in cited if not os.path.isfile(os.path.join(ROOT, c))] == []
    assert "ALGORITHMS.md" not in open(os.path.join(ROOT, "README.md")).read()
