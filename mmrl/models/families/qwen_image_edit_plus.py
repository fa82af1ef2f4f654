"""Qwen-Image-Edit-Plus (`QwenImageEditPlusPipeline`; Qwen-Image-Edit-2509 and -2511): Qwen-Image-Edit with one
or more images per example (`"images": [paths]`; 1 to 3, the model card's range).

All of qwen_image_edit.py holds, with the spec below: the prompt is preceded by "Picture i: <|vision_start|>
<|image_pad|><|vision_end|>" for each image i, the VLM sees each image at 384 x 384 px
(`calculate_dimensions(384 * 384, aspect)`) while the VAE encodes it at 1024 x 1024 px; the images' packed latents
follow x's tokens in order (img_shapes [(1, H/2, W/2), (1, s/2, s/2) per image], image i on RoPE frame i), and the
output keeps x's HW/4 tokens. -2511's transformer has `zero_cond_t`: the image tokens are modulated at timestep 0
(the transformer reads that from img_shapes, which mmrl passes as the pipeline does). Rows with fewer than
MAX_IMAGES images carry zeros in the unused slots of pooled and run in a transformer call of their own count.
"""

from __future__ import annotations

from mmrl.models.families.qwen_image_edit import QWEN_IMAGE, Edit, edit_family

MAX_IMAGES = 3
PLUS = Edit("qwen_image_edit_plus", "QwenImageEditPlusPipeline", max_images=MAX_IMAGES, vlm_side=384,
            image_prompt="Picture {}: <|vision_start|><|image_pad|><|vision_end|>")  # the pipeline's own text

# Qwen/Qwen-Image-Edit-2509 and -2511, transformer/config.json: Qwen-Image's transformer (20.6 B; plan: 20.43 B),
# -2511's with zero_cond_t (no parameters). The tiny transformer is -2511's.
FAMILY = edit_family(PLUS, {"qwen-image-edit-2509": {"config": QWEN_IMAGE},
                            "qwen-image-edit-2511": {"config": {**QWEN_IMAGE, "zero_cond_t": True}}}, zero_cond_t=True)
