"""Video rewards from image rewards: per-frame scoring with an aggregate, and temporal consistency.

Videos are [N, 3, F, H, W] in [-1, 1] (the flow policy's video outputs).
- FrameReward: any image reward (config: a REWARDS key and its reward_kwargs) on every frame (or every `stride`-th), aggregated per video by
  mean or min; each of the image reward's keys is aggregated the same way.
- TemporalConsistency: the mean cosine similarity of consecutive frames' embeddings, in [-1, 1]: CLIP image
  embeddings (`embed: clip`, any open_clip model and checkpoint) or the flattened pixels centered per frame
  (`embed: pixels`, no model). 1 = no change between frames; pays for stability, so combine it with a
  content reward (reward.name=multi), never alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.errors import ConfigError


def frames_of(videos: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """[N, 3, F, H, W] -> [N, F', 3, H, W] with F' = ceil(F / stride)."""
    if videos.dim() != 5:
        raise ValueError(f"video rewards take videos [N, 3, F, H, W]; got shape {tuple(videos.shape)}")
    return videos[:, :, ::stride].transpose(1, 2)


class FrameReward:
    def __init__(self, reward="clip_score", agg: str = "mean", stride: int = 1):
        """reward: the image reward, built by mmrl.compose from the config's `reward` name and `reward_kwargs`."""
        if agg not in ("mean", "min"):
            raise ConfigError(f"FrameReward agg={agg!r}; valid: mean, min")
        self.image_reward, self.agg, self.stride = reward, agg, stride

    def __call__(self, videos: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        fr = frames_of(videos, self.stride)  # [N, F', 3, H, W]
        n, f = fr.shape[:2]
        out = self.image_reward(fr.reshape(n * f, *fr.shape[2:]), [e for e in examples for _ in range(f)])
        red = (lambda v: v.mean(1)) if self.agg == "mean" else (lambda v: v.min(1).values)
        return {k: red(torch.as_tensor(v, dtype=torch.float32).reshape(n, f)) for k, v in out.items()}


class TemporalConsistency:
    def __init__(self, embed: str = "pixels", arch: str = "ViT-B-32", pretrained: str | None = None,
                 batch_size: int = 64, device: str = "cpu", random_weights: bool = False):
        if embed not in ("pixels", "clip"):
            raise ConfigError(f"TemporalConsistency embed={embed!r}; valid: pixels, clip")
        self.embed = embed
        if embed == "clip":
            from rewards.clip_models import _OpenClipReward

            self.clip = _OpenClipReward(arch, pretrained, batch_size, device, random_weights=random_weights,
                                        name="temporal_consistency")

    def embeddings(self, videos: torch.Tensor) -> torch.Tensor:
        fr = frames_of(videos)  # [N, F, 3, H, W]
        n, f = fr.shape[:2]
        if self.embed == "clip":
            return self.clip.image_features(fr.reshape(n * f, *fr.shape[2:])).reshape(n, f, -1)
        x = fr.reshape(n, f, -1).float()
        return x - x.mean(-1, keepdim=True)

    def __call__(self, videos: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        e = self.embeddings(videos)  # [N, F, D]
        if e.shape[1] < 2:
            raise ConfigError("temporal consistency needs videos of at least 2 frames")
        return {"overall": F.cosine_similarity(e[:, 1:], e[:, :-1], dim=-1, eps=1e-8).mean(1)}
