"""Output for people (mmrl/report.py, issue 44): the verdict rule on hand numbers, the end-of-run table, --json,
one printing rank, the evaluation line and its progress lines in a log file, TensorBoard steps = logged iterations."""

import json
import logging
import os
import re
import time

import pytest

from mmrl import evaluation
from mmrl.config import Config
from mmrl.evaluation import evaluate_outputs, standard_error
from mmrl.report import emit, eval_line, format_table, summary, verdict


def ev(overall: float, scores=None, se=None, cats=None) -> dict:
    res = {"overall": overall, "strict": overall / 2, "n": len(scores or [0] * 4), "per_category": cats or {}}
    if scores is not None:
        res["scores"] = {"overall": scores}
    if se is not None:
        res["se"] = {"overall": se}
    return res


def test_standard_error_by_hand():
    assert standard_error([1.0, 3.0]) == pytest.approx(1.0)  # sd sqrt(2), / sqrt(2)
    assert standard_error([0.5]) == 0.0


def test_verdict_rule_on_hand_numbers():
    # paired, every prompt +0.2: the difference has no spread, a real gain
    v = verdict(ev(0.5, [0.2, 0.4, 0.6, 0.8]), ev(0.7, [0.4, 0.6, 0.8, 1.0]))
    assert v["paired"] and v["se"] == 0.0 and v["change"] == pytest.approx(0.2) and v["verdict"] == "a real gain"
    # paired differences 0.1, -0.1, 0.3, -0.1: mean 0.05, sd sqrt(0.11 / 3) = 0.1915, se 0.0957; 0.05 < 2 se
    v = verdict(ev(0.5, [0.5, 0.5, 0.5, 0.5]), ev(0.55, [0.6, 0.4, 0.8, 0.4]))
    assert v["se"] == pytest.approx(0.0957, abs=1e-4) and v["verdict"] == "too few iterations to tell"
    # the same means with the unpaired rule (no per-example scores): se hypot(0.01, 0.02) = 0.02236; 0.05 > 2 se
    v = verdict(ev(0.5, se=0.01), ev(0.55, se=0.02))
    assert not v["paired"] and v["se"] == pytest.approx(0.0224, abs=1e-4) and v["verdict"] == "a real gain"
    assert verdict(ev(0.55, se=0.01), ev(0.5, se=0.02))["verdict"] == "a real drop"
    assert verdict(None, ev(0.5))["verdict"] == "no evaluation before training"


def results_for(cfg, before, after, iterations=3, command=None):
    res = {"eval_start": before, "eval_end": after, "iterations": iterations, "eval_timed": []}
    res["summary"] = summary(res, cfg, 125.0, 1.5, os.path.join(cfg.log.out_dir, "checkpoints", "iter-000003"),
                             command)
    return res


def test_the_end_of_run_table():
    cfg = Config()
    cfg.log.out_dir, cfg.train.iterations, cfg.train.time_budget_min, cfg.log.image_every = "runs/q", 40, 0, 5
    cats = lambda a, b: {"single_object": {"overall": a, "n": 2}, "counting": {"overall": b, "n": 2}}  # noqa: E731
    res = results_for(cfg, ev(0.5, [0.5] * 4, cats=cats(0.6, 0.4)), ev(0.55, [0.6, 0.4, 0.8, 0.4], cats=cats(0.7, 0.4)),
                      command="mmrl train configs/quickstart.yaml log.out_dir=runs/q train.iterations=40")
    table = format_table(res)
    print(table)
    assert table.splitlines()[0] == ("3 iterations (train.iterations=40): 1.5 min of training in all; this command "
                                     "took 2 min 05 s")  # after a resume the two differ, and say which is which
    assert re.search(r"^overall\s+0\.500\s+0\.550$", table, re.M) and re.search(r"^strict\s+0\.250\s+0\.275$", table, re.M)
    assert re.search(r"^  single_object \(overall, n=2\)\s+0\.600\s+0\.700$", table, re.M)
    assert "verdict: too few iterations to tell: overall 0.500 -> 0.550, change +0.050 ± 0.096" in table
    # the command that trains longer: the run's own line, its iteration count replaced
    assert "train longer: mmrl train configs/quickstart.yaml log.out_dir=runs/q --resume train.iterations=13" in table
    assert "checkpoints: runs/q/checkpoints (newest iter-000003)" in table
    assert "logs: runs/q/metrics.jsonl; tensorboard --logdir runs/q/tb" in table
    assert "samples: image grids every 5 iterations in TensorBoard (Images)" in table
    # 3 of 40 iterations (< half): the end of the run says so, naming what cut it
    assert "NOTE: only 3 of train.iterations=40 iterations ran (the run was stopped)" in table
    cfg.train.time_budget_min = 2
    s = results_for(cfg, ev(0.5, [0.5] * 4), ev(0.7, [0.7] * 4))["summary"]
    assert "train.time_budget_min=2 ran out" in s["short"] and s["verdict"]["verdict"] == "a real gain"
    assert "longer" not in s["verdict"]  # a real gain needs no longer run
    cfg.train.iterations = 6
    assert "short" not in results_for(cfg, ev(0.5), ev(0.5))["summary"]  # 3 of 6: not far short


def test_json_flag_and_one_printing_rank(capsys, monkeypatch):
    cfg = Config()
    cfg.log.out_dir = "runs/q"
    res = results_for(cfg, ev(0.5, [0.5] * 4), ev(0.7, [0.7] * 4))
    emit(res, as_json=True)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(res))
    emit(res)
    out = capsys.readouterr().out
    assert "verdict: a real gain" in out and not out.startswith("{")
    emit(res, main=False)  # a fake rank 1
    emit(res, as_json=True, main=False)
    monkeypatch.setenv("RANK", "1")  # torchrun's second process
    emit(res)
    assert capsys.readouterr().out == ""


def test_eval_line_is_for_people():
    res = {"overall": 0.4123, "strict": 0.3, "n": 504, "se": {"overall": 0.021, "strict": 0.02},
           "scores": {"overall": [0.1]}, "per_category": {"single_object": {"overall": 0.8, "n": 80},
                                                         "counting": {"overall": 0.31, "n": 80}}}
    assert eval_line(30, res) == ("eval at iteration 30: overall 0.412 ± 0.021, strict 0.300 (n=504) | "
                                  "single_object 0.80, counting 0.31")


def test_evaluation_progress_lines_in_a_log_file(monkeypatch, caplog):
    """Without a bar (log.progress=false) the evaluation logs `evaluating: i/n` at once and every PROGRESS_S
    seconds, also while one batch is still generating; the other ranks (progress=None) say nothing."""
    import torch

    monkeypatch.setattr(evaluation, "PROGRESS_S", 0.1)
    examples = [{"prompt": str(i), "category": "ab"[i % 2]} for i in range(6)]

    def generate(chunk, first_seed):
        time.sleep(0.35)  # a slow batch: the heartbeat speaks during it
        return torch.arange(first_seed, first_seed + len(chunk), dtype=torch.float32)

    reward = lambda out, chunk: {"overall": (out % 2 == 0).float()}  # noqa: E731  seeds 0..5: 1, 0, 1, 0, 1, 0
    with caplog.at_level(logging.INFO, logger="mmrl.evaluation"):
        res = evaluate_outputs(generate, examples, reward, seed=0, batch_size=3, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluating: ")]
    assert lines[0].startswith("evaluating: 0/6") and any(x.startswith("evaluating: 3/6") for x in lines)
    assert len(lines) >= 4
    assert res["overall"] == 0.5 and res["scores"]["overall"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert res["se"]["overall"] == pytest.approx(standard_error([1, 0, 1, 0, 1, 0]), abs=1e-4)
    assert res["per_category"] == {"a": {"n": 3, "overall": 1.0}, "b": {"n": 3, "overall": 0.0}}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmrl.evaluation"):
        evaluate_outputs(generate, examples, reward, batch_size=3, progress=None)
    assert not caplog.records


def test_noise_draws_merge_by_hand():
    """`mmrl eval --draws K`: K evaluations of the same examples under seeds s, s+1, ...; the means, the
    per-category means and the per-example scores are averaged over draws, each draw's mean is kept."""
    import torch

    examples = [{"prompt": str(i), "category": "ab"[i % 2]} for i in range(4)]
    generate = lambda chunk, s: torch.arange(s, s + len(chunk), dtype=torch.float32)  # noqa: E731
    reward = lambda out, chunk: {"overall": (out % 3 == 0).float()}  # noqa: E731
    # seeds 0-3: 1, 0, 0, 1; 1-4: 0, 0, 1, 0; 2-5: 0, 1, 0, 0
    res = evaluate_outputs(generate, examples, reward, seed=0, progress=None, draws=3)
    assert res["draws"] == {"overall": [0.5, 0.25, 0.25]}
    assert res["overall"] == pytest.approx(1 / 3, abs=1e-4) and res["n"] == 4
    assert res["scores"]["overall"] == pytest.approx([1 / 3] * 4, abs=1e-4) and res["se"]["overall"] == 0.0
    # a (examples 0, 2): 0.5, 0.5, 0; b (1, 3): 0.5, 0, 0.5
    assert res["per_category"]["a"] == pytest.approx({"n": 2, "overall": 1 / 3}, abs=1e-4)
    assert res["per_category"]["b"] == pytest.approx({"n": 2, "overall": 1 / 3}, abs=1e-4)
    one = evaluate_outputs(generate, examples, reward, seed=0, progress=None)  # one draw: the evaluation itself
    assert "draws" not in one and one == evaluate_outputs(generate, examples, reward, seed=0, progress=None, draws=1)


def test_a_long_iteration_says_what_it_is_doing_in_a_log_file(tiny_pixel_model, tmp_path, monkeypatch, caplog):
    """Without bars (a log file) an iteration that runs longer than ITERATION_PULSE_S logs which phase it is in
    (rollout, reward, train ...) every ITERATION_PULSE_S seconds, then its one summary line; nothing after it."""
    from mmrl import trainer as trainer_module
    from mmrl.compose import load_config

    monkeypatch.setattr(trainer_module, "ITERATION_PULSE_S", 0.05)
    cfg = load_config("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}",
                      "log.tensorboard=false", "log.progress=false", "log.eval_at_start=false", "train.iterations=1",
                      "task.eval_prompts=2"])
    with caplog.at_level(logging.INFO, logger="mmrl.trainer"):
        trainer_module.Trainer(cfg).fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iteration 1/1")]
    pulses = [x for x in lines if "s so far" in x]
    assert pulses and {x.split(": ")[1].split(",")[0] for x in pulses} & {"rollout", "reward", "train"}
    assert "reward" in lines[-1] and "so far" not in lines[-1]  # the summary line comes last
