"""Tiny random-init stand-ins of the reward models real recipes load (the real transformers classes, built from
configs in code, saved with save_pretrained): an OWLv2 detector and a CLIPModel (GenEval, PickScore), and Qwen2-VL
reward-model folders with their reward tokens and head (HPSv3, VideoAlign). Their scores are noise; they check that
a recipe's reward loads, runs on the policy's device and feeds the trainer. Used by the tests and
scripts/gpu_check.py."""

from __future__ import annotations

import os

import torch

WORDS = "a photo of an the dog cat car red orange yellow green blue purple pink brown black white object colored -"
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


def clip_tokenizer(words: str = WORDS):
    from mmrl.models.qwen_vl import build_tokenizer

    tok = build_tokenizer([words] * 4, vocab_size=300)
    tok.padding_side, tok.model_max_length = "right", 16  # OWLv2 masks a query whose first token is padding
    return tok


def text_config(tok) -> dict:
    return dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.pad_token_id, **TEXT)


def tiny_owlv2(path: str, seed: int = 0) -> str:
    """An Owlv2ForObjectDetection folder with its processor (32 px input)."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    Owlv2ForObjectDetection(Owlv2Config(text_config=text_config(tok), vision_config=VISION,
                                        projection_dim=32)).save_pretrained(path)
    Owlv2Processor(Owlv2ImageProcessor(size={"height": 32, "width": 32}), tok).save_pretrained(path)
    return path


def tiny_clip(path: str, seed: int = 0) -> str:
    """A CLIPModel folder with its tokenizer and image processor (GenEval's colour classifier, PickScore)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text_config(tok), vision_config=VISION, projection_dim=16)).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def tiny_qwen2vl_reward(path: str, kind: str, seed: int = 0) -> str:
    """A Qwen2-VL folder that holds a whole reward model: `kind` "hpsv3" (<|Reward|>, the ranknet head) or
    "video_align" (the VQ / MQ / TA tokens, a Linear(D, 1) head), the tokens in its tokenizer and rm_head.* saved
    with the weights (the folder form rewards/vlm_reward_models.py loads without a separate checkpoint)."""
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer
    from rewards import vlm_reward_models as vrm

    torch.manual_seed(seed)
    tok = build_tokenizer(["a red circle moving left", vrm.HPSV3_INSTRUCTION, vrm.VIDEOALIGN_PROMPT])
    model = build_model("qwen2_vl", tok, "tiny")
    tokens = ["<|Reward|>"] if kind == "hpsv3" else ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]
    tok.add_special_tokens({"additional_special_tokens": tokens})
    model.resize_token_embeddings(len(tok))
    d = model.config.get_text_config().hidden_size
    if kind == "hpsv3":
        model.rm_head = torch.nn.Sequential(torch.nn.Linear(d, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                                            torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    else:
        model.rm_head = torch.nn.Linear(d, 1, bias=False)
    model.save_pretrained(path)
    build_processor("qwen2_vl", tok).save_pretrained(path)
    return path


def recipe_reward_overrides(root: str, device: str = "cpu") -> dict[str, list[str]]:
    """Overrides pointing each real recipe's reward at tiny stand-ins in `root`: {recipe reward: [section.key=v]}."""
    owl, clip = tiny_owlv2(os.path.join(root, "owlv2")), tiny_clip(os.path.join(root, "clip"))
    geneval = f'{{"detector": "owlv2", "detector_path": "{owl}", "clip_path": "{clip}", "device": "{device}"}}'
    pick = f'{{"path": "{clip}", "processor_path": "{clip}", "device": "{device}"}}'
    va = tiny_qwen2vl_reward(os.path.join(root, "video_align"), "video_align")
    return {
        "geneval": [f"reward.kwargs={geneval}"],
        "pickscore": [f"reward.kwargs={pick}"],
        "geneval_pickscore": [
            f'reward.kwargs={{"components": {{"geneval": {{"weight": 1.0, "kwargs": {geneval}}}, '
            f'"pickscore": {{"weight": [[0, 0.0], [100, 0.5]], "kwargs": {pick}}}}}}}', f"reward.eval_kwargs={geneval}"],
        "video_align": [f'reward.kwargs={{"path": "{va}", "checkpoint": null, "video_fps": 16, "device": "{device}", '
                        f'"batch_size": 2}}'],
    }


def output_spread(outputs) -> torch.Tensor:
    """A statistic that differs between the samples of a group, whatever they are: the mean of each image or video
    (tensors [N, ...]), or the fraction of distinct characters of each text. [N]"""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach().float().flatten(1).mean(1).cpu()
    return torch.tensor([len(set(str(o))) / max(len(str(o)), 1) for o in outputs])


class WithSpread:
    """A recipe's reward plus `weight` x output_spread: the tiny stand-ins' scores are often constant (a random
    detector finds nothing, a random VLM answers nothing parseable), which gives zero advantages and trains nothing;
    this term makes rewards vary within groups so a check run exercises a non-zero loss. Logged as reward/spread."""

    def __init__(self, reward, weight: float = 1.0):
        self.reward, self.weight = reward, weight
        self.needs_groups = getattr(reward, "needs_groups", False)

    def __call__(self, outputs, examples, *group_id):
        scores = dict(self.reward(outputs, examples, *group_id))
        spread = output_spread(outputs).to(scores["overall"].device)
        return {**scores, "spread": spread, "overall": scores["overall"] + self.weight * spread}


def spread(outputs, examples) -> dict[str, torch.Tensor]:
    """output_spread as a reward of its own (a component of reward.name=multi)."""
    s = output_spread(outputs)
    return {"overall": s}


def with_spread(cfg, weight: float = 1.0):
    """`cfg` (a loaded Config) with its training reward wrapped in WithSpread (reward.name=multi: `spread` added as
    one more component, so aggregations over components keep working); held-out evaluation keeps the recipe's own
    reward (reward.eval_name)."""
    r = cfg.reward
    if r.name == "multi":
        r.kwargs = {**r.kwargs, "components": {**r.kwargs["components"], "spread": {
            "name": "mmrl.testing.tiny_rewards:spread", "weight": weight}}}
        return cfg
    if not r.eval_name:
        r.eval_name, r.eval_kwargs = r.name, dict(r.kwargs)
    r.kwargs = {"reward": r.name, "reward_kwargs": dict(r.kwargs), "weight": weight}
    r.name = "mmrl.testing.tiny_rewards:WithSpread"
    return cfg
