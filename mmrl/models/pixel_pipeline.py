"""A diffusers pipeline for mmrl's pixel-space image models (the shapes world's base and what mmrl trains from it).

This file is standalone (diffusers, transformers and torch only): `mmrl export` copies it into the exported folder as
`pipeline.py`, so the export loads with diffusers alone:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("OUT", custom_pipeline="OUT", trust_remote_code=True)  # OUT: the export
    # (trust_remote_code: diffusers runs OUT/pipeline.py, this file)
    images = pipe(["two red circles"], num_inference_steps=16, guidance_scale=1.0).images

It samples as mmrl's evaluation does (mmrl/models/flow_model.py FlowModel.generate): an SD3Transformer2DModel over
RGB pixels [N, 3, H, W] (no VAE), timestep = 1000 sigma, a CLIP text model's last hidden state and projected
embedding as its conditioning, classifier-free guidance against the empty prompt, Euler steps of the
FlowMatchEulerDiscreteScheduler's sigmas with the given shift; one generator per image draws its initial noise.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from PIL import Image


class MMRLPixelPipeline(DiffusionPipeline):
    def __init__(self, transformer, text_encoder, tokenizer, scheduler, sample_size: int = 36, channels: int = 3,
                 prediction: str = "velocity", transformer_class: str = "SD3Transformer2DModel"):
        super().__init__()
        if transformer_class != "SD3Transformer2DModel":
            raise ValueError(f"MMRLPixelPipeline samples image models; this folder's transformer is {transformer_class} "
                             f"(a video model: load it with mmrl's load_policy_checkpoint)")
        self.register_modules(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer,
                              scheduler=scheduler)
        self.register_to_config(sample_size=sample_size, channels=channels, prediction=prediction,
                                transformer_class=transformer_class)

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(last hidden state [B, L, D], projected embedding [B, P]) of texts."""
        ids = self.tokenizer(list(texts), padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").to(self.text_encoder.device)
        out = self.text_encoder(input_ids=ids.input_ids, attention_mask=ids.attention_mask)
        return out.last_hidden_state, out.text_embeds

    def velocity(self, x, sigma, enc, pooled):
        out = self.transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                               timestep=sigma * 1000, return_dict=False)[0].float()
        if self.config.prediction == "sample":  # the transformer predicts x0: v = (x - x0) / sigma
            return (x.float() - out) / sigma.float().clamp(min=0.05).view(-1, 1, 1, 1)  # mmrl: SIGMA_MIN_X_PRED
        return out

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int = 16, guidance_scale: float = 1.0,
                 shift: float = 1.0, generator: torch.Generator | list[torch.Generator] | None = None,
                 output_type: str = "pil", return_dict: bool = True):
        """Images of `prompt` (PIL, or a tensor [N, 3, H, W] in [-1, 1] with output_type="pt")."""
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        n, size, device = len(texts), self.config.sample_size, self.transformer.device
        gens = generator if isinstance(generator, list) else [generator] * n
        x = torch.stack([torch.randn(self.config.channels, size, size, generator=g) for g in gens]).to(device)
        enc, pooled = self.encode(texts)
        if guidance_scale != 1.0:
            neg_enc, neg_pooled = self.encode([""])
            neg_enc, neg_pooled = neg_enc.expand(n, -1, -1), neg_pooled.expand(n, -1)
        sch = FlowMatchEulerDiscreteScheduler(shift=shift)
        sch.set_timesteps(num_inference_steps)
        sigmas = sch.sigmas.float()
        for i in self.progress_bar(range(num_inference_steps)):
            s = sigmas[i].expand(n).to(device)
            v = self.velocity(x, s, enc, pooled)
            if guidance_scale != 1.0:
                v_u = self.velocity(x, s, neg_enc, neg_pooled)
                v = v_u + guidance_scale * (v - v_u)
            x = x.float() + v * (sigmas[i + 1] - sigmas[i])
        images = x.clamp(-1, 1)
        if output_type == "pil":
            arr = ((images.permute(0, 2, 3, 1).cpu().numpy() + 1) * 127.5).round().astype(np.uint8)
            images = [Image.fromarray(a) for a in arr]
        return ImagePipelineOutput(images=images) if return_dict else (images,)
