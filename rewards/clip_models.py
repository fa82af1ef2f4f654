"""Pointwise image reward models on CLIP backbones, with the loading code of their released weights.

| reward      | backbone                                | weights (local files; no hub here)                     | score range   |
|-------------|-----------------------------------------|--------------------------------------------------------|---------------|
| clip_score  | open_clip `arch` (e.g. ViT-L-14)        | `pretrained`: an open_clip or OpenAI CLIP checkpoint    | 2.5*max(cos,0) in [0, 2.5] (Hessel et al. 2021) |
| pickscore   | transformers CLIPModel                  | `path`: a PickScore_v1 folder (model + processor)       | 100*cos-ish, about 18..24 |
| hpsv2       | open_clip ViT-H-14                      | `checkpoint`: HPS_v2(.1)_compressed.pt ("state_dict")   | cos, about 0.2..0.35 |
| aesthetic   | open_clip ViT-L-14 image tower + MLP    | `clip_pretrained` + `mlp`: the LAION predictor (.pth)   | about 1..10 |

(ImageReward, on BLIP, is in rewards/image_reward.py; OCR in rewards/ocr.py; video rewards in rewards/video.py.)

Every reward loads its model on the first call, once; takes images [N, 3, H, W] in [-1, 1] (the generators'
output range), preprocesses them in torch on the model's device (bicubic resize of the short side to the
model's size, center crop, the model's mean / std: what the models' own PIL pipelines do, without the PIL round
trip), and scores in batches of `batch_size`. Checkpoints load with `weights_only=True` (or safetensors; OpenAI's
TorchScript archives, which weights_only cannot read, through torch.jit.load, keeping only their tensors). A reward
without its weights refuses to run unless `random_weights: true` is passed (tests, smoke runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.errors import ConfigError


def clip_preprocess(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """[N, 3, H, W] in [-1, 1] -> [N, 3, size, size] normalized: resize the short side to `size` (bicubic,
    antialiased), center crop, (x - mean) / std."""
    x = (images.float().clamp(-1, 1) + 1) / 2
    h, w = x.shape[-2:]
    s = size / min(h, w)
    # torchvision's Resize / CenterCrop arithmetic: the long side truncated, the crop offset rounded
    x = F.interpolate(x, size=(max(size, int(h * s)), max(size, int(w * s))), mode="bicubic",
                      align_corners=False, antialias=True).clamp(0, 1)
    top, left = round((x.shape[-2] - size) / 2), round((x.shape[-1] - size) / 2)
    x = x[..., top:top + size, left:left + size]
    mean = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def _tensor(out) -> torch.Tensor:
    """transformers 5 returns the projected features as an output object's pooler_output; older versions a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _prompts(examples) -> list[str]:
    return [e if isinstance(e, str) else e["prompt"] for e in examples]


OPENAI_META_KEYS = ("input_resolution", "context_length", "vocab_size")  # ints in OpenAI's CLIP state dicts


def load_state(path: str) -> dict:
    """A state dict from .safetensors, a torch file (weights_only) or OpenAI's TorchScript CLIP archive (which
    weights_only cannot read: torch.jit.load opens it and only its state dict is kept, the model is never run);
    a {"state_dict": ...} wrapper is opened."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError as e:
        if "TorchScript" not in str(e):
            raise
        sd = torch.jit.load(path, map_location="cpu").state_dict()  # OpenAI's released ViT-*.pt archives
    return sd.get("state_dict", sd) if isinstance(sd, dict) else sd


def is_openai_format(path: str, state: dict) -> bool:
    """OpenAI's CLIP checkpoints (TorchScript archives, or state dicts that carry the config as integer entries);
    their models use QuickGELU."""
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            if any(n.split("/", 1)[-1].startswith("code/") for n in z.namelist()):
                return True
    return all(k in state for k in OPENAI_META_KEYS)


def require_weights(name: str, given: dict, random_weights: bool) -> None:
    """A reward model without its checkpoint scores with random weights: refuse unless asked for explicitly."""
    missing = [k for k, v in given.items() if not v]
    if missing and not random_weights:
        raise ConfigError(f"{name}: no weights given ({', '.join(missing)}): a random-init reward model scores noise. "
                          f"Pass the checkpoint path(s) in reward.kwargs, or random_weights: true for a smoke test")


class _OpenClipReward:
    """Shared by the open_clip rewards: lazy model, preprocessing, batched normalized embeddings.
    quick_gelu: the activation of OpenAI's CLIP models (and the -quickgelu open_clip configs); None = on for an
    OpenAI-format checkpoint (TorchScript archive or state dict with its config entries), off otherwise."""

    def __init__(self, arch: str, pretrained: str | None = None, batch_size: int = 32, device: str = "cpu",
                 quick_gelu: bool | None = None, random_weights: bool = False, name: str = "clip reward"):
        require_weights(name, {"pretrained": pretrained}, random_weights)
        self.arch, self.pretrained, self.batch_size, self.device = arch, pretrained, batch_size, device
        self.quick_gelu = quick_gelu
        self.model = None

    def _build(self):
        import open_clip

        state = load_state(self.pretrained) if self.pretrained else None
        openai = state is not None and is_openai_format(self.pretrained, state)
        quick = self.quick_gelu if self.quick_gelu is not None else openai
        model = open_clip.create_model(self.arch, pretrained=None, force_quick_gelu=quick)
        if state is not None:
            # a TorchScript archive also holds non-persistent buffers (attn_mask): extra keys are fine, missing are not
            missing, _ = model.load_state_dict({k: v for k, v in state.items() if k not in OPENAI_META_KEYS},
                                               strict=False)
            if missing:
                raise ConfigError(f"{self.pretrained}: not a {self.arch} checkpoint, missing {missing[:4]} ...")
        return model

    def _load(self):
        if self.model is None:
            import open_clip

            self.model = self._build().to(self.device).eval().requires_grad_(False)
            cfg = open_clip.get_model_preprocess_cfg(self.model)
            self.size, self.mean, self.std = cfg["size"][0] if isinstance(cfg["size"], tuple) else cfg["size"], cfg["mean"], cfg["std"]
            self.tokenizer = open_clip.get_tokenizer(self.arch)
        return self.model

    @torch.no_grad()
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """[N, D] unit-norm image embeddings."""
        m = self._load()
        out = [m.encode_image(clip_preprocess(images[s:s + self.batch_size], self.size, self.mean, self.std)
                              .to(self.device), normalize=True).float().cpu()
               for s in range(0, len(images), self.batch_size)]
        return torch.cat(out)

    @torch.no_grad()
    def text_features(self, texts: list[str]) -> torch.Tensor:
        m = self._load()
        out = [m.encode_text(self.tokenizer(texts[s:s + self.batch_size]).to(self.device), normalize=True).float().cpu()
               for s in range(0, len(texts), self.batch_size)]
        return torch.cat(out)

    def cosine(self, images, examples) -> torch.Tensor:
        return (self.image_features(images) * self.text_features(_prompts(examples))).sum(-1)


class CLIPScore(_OpenClipReward):
    """CLIPScore = weight * max(cos(image, caption), 0), weight 2.5 (Hessel et al. 2021). arch / pretrained:
    any open_clip model name and a local checkpoint file of it."""

    def __init__(self, arch: str = "ViT-L-14", pretrained: str | None = None, weight: float = 2.5, **kw):
        super().__init__(arch, pretrained, name="clip_score", **kw)
        self.weight = weight

    def __call__(self, images, examples) -> dict[str, torch.Tensor]:
        cos = self.cosine(images, examples)
        return {"overall": self.weight * cos.clamp(min=0), "cosine": cos}


class HPSv2(_OpenClipReward):
    """HPSv2 / HPSv2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences; score = cos of
    the image and caption embeddings. checkpoint: HPS_v2_compressed.pt or HPS_v2.1_compressed.pt."""

    def __init__(self, checkpoint: str | None = None, arch: str = "ViT-H-14", **kw):
        super().__init__(arch, checkpoint, name="hpsv2", **kw)

    def __call__(self, images, examples) -> dict[str, torch.Tensor]:
        return {"overall": self.cosine(images, examples)}


class AestheticMLP(torch.nn.Module):
    """The LAION improved aesthetic predictor's head on unit-norm CLIP ViT-L/14 image embeddings; the layer
    indices match the released state dict (layers.0/2/4/6/7; dropouts are inactive at eval)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.layers(emb).squeeze(-1)


class Aesthetic(_OpenClipReward):
    """LAION aesthetic score: AestheticMLP(normalized CLIP image embedding). The caption is not used.
    clip_pretrained: the OpenAI ViT-L-14 open_clip checkpoint; mlp: sac+logos+ava1-l14-linearMSE.pth."""

    def __init__(self, mlp: str | None = None, clip_pretrained: str | None = None, arch: str = "ViT-L-14", **kw):
        require_weights("aesthetic", {"mlp": mlp}, kw.get("random_weights", False))
        super().__init__(arch, clip_pretrained, name="aesthetic", **kw)
        self.mlp_path, self.head = mlp, None

    def __call__(self, images, examples) -> dict[str, torch.Tensor]:
        emb = self.image_features(images)
        if self.head is None:
            self.head = AestheticMLP(emb.shape[-1]).eval()
            if self.mlp_path:
                self.head.load_state_dict(load_state(self.mlp_path))
        with torch.no_grad():
            return {"overall": self.head(emb)}


class PickScore:
    """PickScore (Kirstain et al. 2023): a transformers CLIPModel fine-tuned on Pick-a-Pic; score =
    logit_scale.exp() * cos(image, caption). path: a local PickScore_v1 folder; processor_path: the folder of
    its tokenizer and image processor (PickScore uses laion/CLIP-ViT-H-14-laion2B-s32B-b79K's; default: path)."""

    def __init__(self, path: str, processor_path: str | None = None, batch_size: int = 32, device: str = "cpu"):
        self.path, self.processor_path = path, processor_path or path
        self.batch_size, self.device = batch_size, device
        self.model = None

    def _load(self):
        if self.model is None:
            from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

            model = CLIPModel.from_pretrained(self.path).to(self.device).eval().requires_grad_(False)
            self.tokenizer = AutoTokenizer.from_pretrained(self.processor_path)
            ip = CLIPImageProcessor.from_pretrained(self.processor_path)
            crop = ip.crop_size if isinstance(ip.crop_size, int) else ip.crop_size["height"]
            self.size, self.mean, self.std = crop, ip.image_mean, ip.image_std
            self.model = model  # last: a load that failed half-way is tried again, not half used
        return self.model

    @torch.no_grad()
    def __call__(self, images, examples) -> dict[str, torch.Tensor]:
        m = self._load()
        texts, out = _prompts(examples), []
        for s in range(0, len(texts), self.batch_size):
            px = clip_preprocess(images[s:s + self.batch_size], self.size, self.mean, self.std).to(self.device)
            tok = self.tokenizer(texts[s:s + self.batch_size], padding=True, truncation=True,
                                           max_length=77, return_tensors="pt").to(self.device)
            img = F.normalize(_tensor(m.get_image_features(pixel_values=px)), dim=-1)
            txt = F.normalize(_tensor(m.get_text_features(**tok)), dim=-1)
            out.append((m.logit_scale.exp() * (img * txt).sum(-1)).float().cpu())
        return {"overall": torch.cat(out)}
