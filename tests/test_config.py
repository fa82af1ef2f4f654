"""Config loading, overrides and validation errors that name the fix."""

import glob
import json
import os
import re

import pytest

from mmrl.algorithms import POLICY_LOSSES
from mmrl.compose import load_config
from mmrl.config_files import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ACCELERATE = os.path.join(ROOT, "configs", "accelerate")


@pytest.mark.parametrize("path", sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)
                                        if not p.startswith(ACCELERATE)))
def test_every_yaml_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.train.group_size >= 2


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ACCELERATE, "*.yaml"))))
def test_accelerate_launch_configs(path):
    """configs/accelerate/ are accelerate's own config files: the keys `accelerate launch --config_file` reads."""
    import yaml

    c = yaml.safe_load(open(path))
    # multinode.yaml leaves the total to the command line (-1: accelerate refuses to start without it)
    assert c["distributed_type"] == "MULTI_GPU" and c["num_processes"] in (8 * c["num_machines"], -1)
    assert c["compute_environment"] == "LOCAL_MACHINE" and 0 <= c["machine_rank"] < c["num_machines"]


def test_overrides_and_types():
    cfg = load_config(None, ["train.lr=3e-5", "sampler.kind=cps", "model.lora.enabled=true", "algo.clip_range_high=0.28"])
    assert cfg.train.lr == 3e-5 and cfg.sampler.kind == "cps" and cfg.model.lora.enabled
    assert cfg.algo.clip_range_high == 0.28


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", r"unknown config key 'train.lrr'.*Did you mean 'lr'"),
    ("trian.lr=1", r"unknown config key 'trian'.*valid keys: \['algo', 'log', 'model'"),
    ("algo.advantage=grpoo", r"algo.advantage: unknown advantage estimator 'grpoo'. Did you mean 'grpo'\? \(valid: \['dr_grpo', 'grpo'\]"),
    ("algo.objective.name=ppo", re.escape(f"valid: {sorted(POLICY_LOSSES)}")),  # the registry, not a list
    ("sampler.kind=ddpm", r"sampler.kind: invalid value 'ddpm'; valid: \['flow_grpo', 'dance', 'cps'\]"),
    ("reward.name=clip", r"reward.name: unknown reward 'clip'; valid: \[.*'shapes'"),
    ("train.group_size=1", r"need >= 2 samples per group"),
    ("train.minibatches=5", r"must divide prompts_per_iter \* group_size = 64"),
    ("sampler.sde_window_size=10", r"sde_window_size must be in \[0, num_steps - 1 = 9\]"),
    ("task.name=prompt_file", r"needs task.prompt_file=PATH"),
    ("log.eval_draws=0", r"log.eval_draws=0: evaluate each example at least once"),
    ("trainlr", r"must look like section.key=value"),
    ("train.iterations=ten", r"'train.iterations' expects int, got 'ten'"),
    # containers are checked from the type hints: a string is not a list of strings
    ("model.lora.target_modules=q_proj", r"'model.lora.target_modules' expects a list \(list\[str\]\), got 'q_proj'.*"
                                         r"write model.lora.target_modules=\[q_proj\]"),
    ("model.lora.target_modules=[1]", r"'model.lora.target_modules\[0\]' expects str, got 1"),
    ("sampler.sde_window_range=5", r"'sampler.sde_window_range' expects a list \(list\[int\]\), got 5"),
    ("sampler.sde_window_range=[0,1,2]", r"sampler.sde_window_range must be \[lo, hi\) window starts"),
    ("model.policy=token sampler.engine=vlm", r"sampler.engine: unknown rollout engine \(sampler.engine\) 'vlm'. Did you mean 'vllm'\?"),
    ("sampler.temperature=0.7", r"sampler.temperature does not apply to model.policy=flow: remove it"),
    ("model.policy=token sampler.num_steps=20", r"sampler.num_steps does not apply to model.policy=token"),
    ("tree.fusion=max", r"tree.fusion: invalid value 'max'; valid: \['mean', 'softmax'\]"),
    ("algo.credit=group tree.split_steps=[0,2] train.group_size=4 algo.loss_agg=token_mean",
     r"algo.credit=group gives one advantage per sample"),
    ("reward.name=no_such_module:Reward", r"reward.name: reward 'no_such_module:Reward' could not be imported"),
])
def test_bad_config_errors_name_the_fix(override, message):
    """Every error at load time (mmrl.compose.load_config), before any model is built."""
    with pytest.raises(ValueError, match=message):
        load_config(None, override.split(" "))


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="configs/t2i/shapes_grpo.yaml"):
        load_config("configs/nope.yaml")


def test_flow_keys_rejected_on_token_policies():
    with pytest.raises(ValueError, match=r"sampler.num_steps does not apply to model.policy=token.*flow policies only"):
        load_config("configs/tiny/vlm_smoke.yaml", ["sampler.num_steps=20"])
    with pytest.raises(ValueError, match=r"model.sample_size does not apply to model.policy=token"):
        load_config("configs/tiny/vlm_smoke.yaml", ["model.sample_size=64"])
    assert load_config("configs/tiny/vlm_smoke.yaml", ["sampler.temperature=0.7"]).sampler.temperature == 0.7


def test_the_token_policy_has_one_name(tmp_path):
    """model.policy=vlm (its former name) is refused naming `token`; a run's saved config.json that says vlm is read
    as token (with a warning); checkpoints write mmrl_policy.json with "token"."""
    with pytest.raises(ValueError, match=r"model.policy=vlm is now model.policy=token"):
        load_config("configs/tiny/vlm_smoke.yaml", ["model.policy=vlm"])
    from mmrl.config import to_dict
    from mmrl.policy import POLICIES

    assert "vlm" not in POLICIES
    saved = to_dict(load_config("configs/tiny/vlm_smoke.yaml"))
    saved["model"]["policy"] = "vlm"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_config(str(tmp_path / "config.json")).model.policy == "token"


def test_an_override_whose_value_is_not_yaml_is_one_config_error():
    """`reward.kwargs={strict_weight:` (a shell-split value) crashed with a YAML traceback."""
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"override 'reward.kwargs=\{strict_weight:': its value is not valid YAML"):
        load_config(None, ["reward.kwargs={strict_weight:"])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_is_refused_naming_its_new_place(old):
    """Every key of the MOVED table (mmrl/config_files.py), set as an older config sets it."""
    value = {"algo.policy_loss": "nft", "algo.reward_shaping": "tempsamp"}.get(old, 2)
    with pytest.raises(ValueError, match=re.escape(f"{old} moved to {MOVED[old][0]}")):
        load_config(None, [f"{old}={value}"])


def test_the_moved_message_is_the_new_form():
    with pytest.raises(ValueError, match=re.escape("algo.nft_beta moved to algo.objective.kwargs.nft_beta "
                                                   "(algo.objective: {name: nft, kwargs: {nft_beta: 2}})")):
        load_config(None, ["algo.nft_beta=2"])
    with pytest.raises(ValueError, match=re.escape("algo.reward_shaping moved to algo.shaping.name, algo.tgrpo_mu "
                                                   "moved to algo.shaping.kwargs.mu (algo.shaping: {name: tgrpo, "
                                                   "kwargs: {mu: 0.5}})")):
        load_config(None, ["algo.reward_shaping=tgrpo", "algo.tgrpo_mu=0.5"])
    cfg = load_config(None, ["algo.objective={name: nft, kwargs: {nft_beta: 2}}"])  # the form it names loads
    assert cfg.algo.objective.name == "nft" and cfg.algo.objective.kwargs == {"nft_beta": 2}


def test_an_older_runs_saved_config_is_translated_with_a_warning(tmp_path, caplog):
    """config.json as mmrl saved it before the loss was named once: `mmrl eval` / checkpoint loading (load_config of
    the file) and --resume (mmrl.runs.saved_config) read it with its keys in their new places, and a resume with the
    same settings in today's form changes nothing."""
    from mmrl.config import Config, to_dict
    from mmrl.runs import config_changes, saved_config

    old = to_dict(Config().validate())
    algo = old["algo"]
    algo["adv_std"] = "population"  # a run saves its config as loaded, algo.adv_std=auto resolved
    del algo["shaping"]
    algo["objective"] = {"name": None, "kwargs": {"clip_range": 0.01}}  # the old sub-config could override a knob
    algo.update(policy_loss="awm_anchored", nft_beta=2.0, dpo_beta=2000.0, dgpo_beta=100.0, dppo_kl_threshold=1e-5,
                tis_cap=0.0, sft_coef=0.0, reward_shaping="none", shaping_tau=0.8, shaping_alpha=1.0,
                tgrpo_alpha=0.3, tgrpo_mu=0.8, tgrpo_threshold=0.5)
    old["sampler"]["kind"], old["log"]["out_dir"] = "ode", str(tmp_path)
    old["sampler"]["cfg_scale"], algo["kl"] = 1.0, "flow_mean"  # a CFG-free loss; the KL estimator's old default
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = load_config(str(tmp_path / "config.json"))
    o = cfg.algo.objective
    assert (o.name, o.kwargs, cfg.algo.clip_range) == ("awm_anchored", {"nft_beta": 2.0}, 0.01)
    assert cfg.algo.shaping.name == "none" and "saved by an older mmrl" in caplog.text
    assert "algo.dpo_beta=2000.0 (a knob of dpo, not of awm_anchored)" in caplog.text
    today = load_config(None, [f"log.out_dir={tmp_path}", "sampler.kind=ode", "algo.clip_range=0.01", "algo.kl=flow_mean",
                               "algo.objective={name: awm_anchored, kwargs: {nft_beta: 2.0}}"])
    assert config_changes(saved_config(str(tmp_path))[1], today) == []
    (tmp_path / "old.yaml").write_text(json.dumps(old))  # the same keys in a config a person wrote: refused
    with pytest.raises(ValueError, match="algo.policy_loss moved to algo.objective.name"):
        load_config(str(tmp_path / "old.yaml"))


@pytest.mark.parametrize("item,match", [
    ("log.save_every=-1", r"log.save_every=-1: must be >= 0 \(0 = only at the end\)"),
    ("train.lr=-1", r"train.lr=-1.0: must be > 0"),
    ("log.eval_every=-1", r"log.eval_every=-1: must be >= 0 \(0 = at start and end only\)"),
    ("sampler.top_p=1.5", r"sampler.top_p=1.5: must be > 0 and <= 1"),
    ("log.keep_checkpoints=0", r"log.keep_checkpoints=0: must be >= 1"),
])
def test_numeric_keys_are_checked_at_load(item, match):
    """Numbers that used to pass `mmrl validate` and then crash or mislead (log.save_every=0 divided by zero at the
    first save; a negative lr trained backwards) are refused at load, naming the range and what 0 means."""
    with pytest.raises(ValueError, match=match):
        load_config(None, [item])
    assert load_config(None, ["log.save_every=0"]).log.save_every == 0  # 0 = only at the end (the trainer's rule)


def test_a_prompt_file_for_a_task_that_does_not_read_it_is_refused():
    """task.prompt_file on a config whose task draws its own prompts (shapes) was silently ignored."""
    with pytest.raises(ValueError, match="task.prompt_file is not read by task.name=shapes, which draws its own"):
        load_config("configs/t2i/shapes_grpo.yaml", ["task.prompt_file=prompts.txt"])
