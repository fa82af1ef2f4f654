"""mmrl's pixel-space video generator (the motion world's base): the pixel family's folders (`MMRLPixelPipeline`)
whose `transformer_class` is a `WanTransformer3DModel` over RGB clips [N, 3, F, H, W] (mmrl/models/families/pixel.py
loads both). LoRA on Wan's attention projections; adapters written in diffusers' format through `WanPipeline`."""

from __future__ import annotations

import dataclasses

from mmrl.models.families import pixel, wan

FAMILY = dataclasses.replace(pixel.FAMILY, name="pixel_video", transformer="WanTransformer3DModel",
                             lora_targets=wan.LORA_TARGETS, lora_pipeline="WanPipeline")
