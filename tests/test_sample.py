"""`mmrl sample`: images and videos of the base beside a checkpoint, scored, on a contact sheet; deterministic;
clear errors. And what `mmrl export` of a pixel world gives other tools (docs/sampling.md)."""

import argparse
import inspect
import json
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl import sample
from mmrl.cli import add_sample_parser

SMOKE = "configs/tiny/flow_smoke.yaml"


def mmrl_sample(*argv: str) -> int:
    """`mmrl sample ...` through mmrl.cli.main once the CLI knows the command; until then parsed and run as the CLI
    does (parse_known_args on the same subparser, left-over key=value items as overrides, a user error -> its
    message on stderr and status 2)."""
    from mmrl import cli

    if "mmrl.sample" in inspect.getsource(cli):
        return cli.main(["sample", *argv])
    p = argparse.ArgumentParser(prog="mmrl")
    add_sample_parser(p.add_subparsers(dest="cmd", required=True))
    args, extra = p.parse_known_args(["sample", *argv])
    args.overrides += extra
    try:
        return sample.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mmrl sample: error: {e}", file=sys.stderr)
        return 2


def save_checkpoint(model_path: str, run_dir) -> str:
    """A trainer-style checkpoint (run/checkpoints/iter-000002/policy) of the model with perturbed weights."""
    from mmrl.compose import build_policy, load_config

    pol = build_policy(load_config(SMOKE, [f"model.path={model_path}", "model.reference=none"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pol.save_pretrained(str(run_dir / "checkpoints" / "iter-000002" / "policy"))
    return str(run_dir)


def rows(out) -> list[dict]:
    return [json.loads(ln) for ln in open(os.path.join(out, "samples.jsonl"))]


def test_images_base_beside_checkpoint_on_a_contact_sheet(tiny_pixel_model, tmp_path):
    run = save_checkpoint(tiny_pixel_model, tmp_path / "run")
    common = [SMOKE, run, "--base", "--n", "3", f"model.path={tiny_pixel_model}", "sampler.eval_steps=2"]
    assert mmrl_sample(*common, "--out", str(tmp_path / "a")) == 0
    assert mmrl_sample(*common, "--out", str(tmp_path / "b")) == 0
    out = tmp_path / "a"
    lines = rows(out)
    assert [(r["model"], r["seed"]) for r in lines] == [(m, i) for m in ("base", "run-iter-000002") for i in range(3)]
    assert all({"overall", "strict", "partial"} <= set(r) and r["file"] == f"{r['model']}/{r['seed']}.png"
               for r in lines)
    png = {r["file"]: (out / r["file"]).read_bytes() for r in lines}
    assert all(png[r["file"]] == (tmp_path / "b" / r["file"]).read_bytes() for r in lines)  # same seed, same bytes
    assert png["base/0.png"] != png["run-iter-000002/0.png"]                   # the checkpoint is not the base
    # the sheet: 2 columns x 3 rows of equal cells, image (row r, column c) at its cell's corner
    sheet = Image.open(out / "contact_sheet.png").convert("RGB")
    tile = sample.fit(np.asarray(Image.open(out / lines[4]["file"])))
    header, cell_w = sample.font()[1] + sample.PAD, max(tile.width, sample.TEXT_W) + 2 * sample.PAD
    cell_h = (sheet.height - header) // 3
    assert sheet.width == 2 * cell_w and sheet.height == header + 3 * cell_h and cell_h > tile.height
    x, y = cell_w + sample.PAD, header + cell_h + sample.PAD                    # row 1, column 1
    assert np.array_equal(np.asarray(sheet.crop((x, y, x + tile.width, y + tile.height))), np.asarray(tile))


def test_prompts_from_files_and_text_and_a_reward_that_fails(tiny_pixel_model, tmp_path, capsys):
    """Literal prompts and files mix; the shapes reward raises on a prompt outside its grammar: that sample is
    written unscored, the others are scored, and the error is printed once."""
    (tmp_path / "p.txt").write_text("# two prompts\na red circle\n\na blue square\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a green triangle"}) + "\n")
    out = tmp_path / "out"
    assert mmrl_sample(SMOKE, f"model.path={tiny_pixel_model}", "--prompts", str(tmp_path / "p.txt"), "a cat",
                       str(tmp_path / "p.jsonl"), "sampler.eval_steps=2", "--out", str(out)) == 0
    lines = rows(out)
    assert [r["prompt"] for r in lines] == ["a red circle", "a blue square", "a cat", "a green triangle"]
    assert ["overall" in r for r in lines] == [True, True, False, True] and "shapes-world" in lines[2]["reward_error"]
    assert all((out / r["file"]).is_file() for r in lines) and (out / "contact_sheet.png").is_file()
    assert capsys.readouterr().err.count("the reward failed") == 1


def test_videos_as_gif_and_mp4_with_frame_strips(tiny_motion_model, tmp_path):
    from tasks import motion

    out = tmp_path / "out"
    assert mmrl_sample("configs/t2v/motion_grpo.yaml", f"model.path={tiny_motion_model}", "--n", "2",
                       "sampler.eval_steps=2", "--out", str(out)) == 0
    lines = rows(out)
    assert len(lines) == 2 and all({"overall", "correct", "progress"} <= set(r) for r in lines)
    gif = Image.open(out / lines[0]["file"])
    assert lines[0]["file"] == "base/0.gif" and gif.n_frames == motion.FRAMES and gif.size == (16, 16)
    if "mp4" in lines[0]:  # PyAV installed (mmrl's video extra)
        import av

        with av.open(str(out / lines[0]["mp4"])) as c:
            assert sum(1 for _ in c.decode(video=0)) == motion.FRAMES
    strip = sample.fit(np.zeros((16, min(motion.FRAMES, 8) * 16, 3), np.uint8))  # up to 8 frames side by side
    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.width == max(strip.width, sample.TEXT_W) + 2 * sample.PAD
    assert (sheet.height - sample.font()[1] - sample.PAD) % 2 == 0                # 2 rows of equal cells


def test_errors_name_the_fix(tiny_pixel_model, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    model = f"model.path={tiny_pixel_model}"
    cases = [([SMOKE, str(tmp_path / "nope")], "does not exist: give a run folder"),
             ([SMOKE, str(tmp_path / "run")], "has no checkpoints/iter-N yet"),
             ([SMOKE, model, "--prompts", str(tmp_path / "empty.txt")], "has no prompts"),
             ([SMOKE, model, "--prompts", str(tmp_path / "missing.txt")], "does not exist"),
             ([SMOKE, f"model.path={tmp_path / 'no-model'}"], "model.path="),
             ([SMOKE, model, "algo.advantage=nope"], "unknown advantage estimator")]
    for argv, message in cases:
        assert mmrl_sample(*argv, "--out", str(tmp_path / "out")) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "out").exists()


def test_exported_pixel_model_loads_by_parts_not_as_a_diffusers_pipeline(tiny_pixel_model, tmp_path):
    """docs/sampling.md: diffusers has no pipeline class for mmrl's pixel models (pixel space, no VAE, one small
    CLIP encoder), so DiffusionPipeline.from_pretrained cannot open the export; its parts load with their own
    classes, and the whole generator with mmrl's load_flow_model, giving the checkpoint's images."""
    import diffusers
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

    from mmrl.export import export
    from mmrl.models.pipelines import load_flow_model
    from mmrl.policy.flow import load_policy_checkpoint

    ck = os.path.join(save_checkpoint(tiny_pixel_model, tmp_path / "run"), "checkpoints", "iter-000002")
    out = export(ck, str(tmp_path / "exported"))
    with pytest.raises(AttributeError, match="MMRLPixelPipeline"):
        diffusers.DiffusionPipeline.from_pretrained(out)
    transformer = diffusers.SD3Transformer2DModel.from_pretrained(out, subfolder="transformer")
    CLIPTextModelWithProjection.from_pretrained(out, subfolder="text_encoder")
    PreTrainedTokenizerFast.from_pretrained(out, subfolder="tokenizer")
    diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    trained = load_policy_checkpoint(ck)
    for k, v in trained.transformer.state_dict().items():
        assert torch.equal(transformer.state_dict()[k], v), k
    images = [m.generate(["a red circle"], [0], num_steps=2, cfg_scale=1.0) for m in (load_flow_model(out), trained)]
    torch.testing.assert_close(images[0], images[1])


def test_token_policy_completions_with_rewards(tmp_path, tiny_arithmetic_lm):
    """A token policy (a tiny causal LM on the arithmetic task): completions and rewards in samples.jsonl."""
    path = tiny_arithmetic_lm
    out = tmp_path / "out"
    assert mmrl_sample("configs/text/smollm2_arithmetic.yaml", f"model.path={path}", "--n", "3", "task.kwargs.hi=20",
                       "sampler.max_new_tokens=4", "--out", str(out)) == 0
    lines = rows(out)
    assert len(lines) == 3 and all(isinstance(r["completion"], str) and "overall" in r for r in lines)
    assert sorted(os.listdir(out)) == ["samples.jsonl"]


def test_the_default_draw_covers_every_category_and_the_report_tells_a_difference(capsys):
    """--n draws held-out examples in turn from each category; the report gives mean ± standard error and the paired
    difference from the first column, saying when the draw cannot tell the two apart."""
    exs = [{"prompt": f"{c}{i}", "category": c} for c in "abc" for i in range(4)]
    assert [e["prompt"] for e in sample.stratified(exs, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert sample.stratified([{"prompt": "x"}] * 3, 5) == [{"prompt": "x"}] * 3
    rows = [{"model": "base", "overall": x} for x in (0.0, 1.0, 0.0, 1.0)] + \
           [{"model": "run", "overall": x} for x in (1.0, 1.0, 1.0, 1.0)]
    sample.report(rows, [("base", "b"), ("run", "r")], 4, "out", {})
    out = capsys.readouterr().out
    assert "mean overall reward 0.5000 ± 0.2887" in out and "mean overall reward 1.0000 ± 0.0000" in out
    assert "run - base: +0.5000 ± 0.2887 (paired over 4 prompts): too few prompts to tell them apart" in out
