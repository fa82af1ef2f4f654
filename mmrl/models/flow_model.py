"""The parts of a flow generator that every flow policy, script and benchmark shares.

`FlowModel` = transformer (diffusers SD3 / FLUX / Wan, or the pixel SD3) + prompt encoder + codec + sigmas:
- `encode_prompts(texts) -> (enc [B, L, D], pooled [B, P])`
- `velocity(x [N, C, H, W], sigma [N], enc, pooled, cfg_scale) -> v [N, C, H, W]` with classifier-free guidance
  `v = v_u + w (v_c - v_u)` computed in one batched forward (uncond first)
- `decode(x) -> images [N, 3, H, W] in [-1, 1]` (identity in pixel space, VAE decode in latent space)

`prediction` says what the transformer outputs: "velocity" (SD3, FLUX, Wan) or "sample" (x-prediction: the
clean image, as JiT argues for pixel-space transformers with large patches); `velocity` always returns v, so
samplers and policies never see the difference (`velocity_from_prediction`).

`mmrl.models.pipelines.load_flow_model(path)` builds one through the folder's model family
(mmrl/models/families/: SD3 / SD3.5, FLUX.1, Wan2.x, Qwen-Image, Z-Image, mmrl's pixel worlds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmrl.models.families.common import static_schedule


EncodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (texts[, images]) -> (enc [B, L, D], pooled [B, P])


def sd3_call(transformer, x, sigma, enc, pooled):
    """The SD3 / SD3.5 transformer call (also the pixel model's): timestep = 1000 sigma."""
    return transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                       timestep=sigma * 1000, return_dict=False)[0]


@dataclass
class FlowModel:
    transformer: torch.nn.Module
    encode_prompts: EncodeFn                     # texts -> (enc [B, L, D], pooled [B, P]); image-conditioned
                                                 # families: (texts, images per row) -> the same, the images'
                                                 # latents carried in pooled for the family's call
    decode: Callable[[torch.Tensor], torch.Tensor]
    latent_shape: tuple[int, ...]                # (C, H, W) or (C, F, H, W) of what the transformer denoises
    text_modules: tuple[torch.nn.Module, ...] = ()  # text encoders (frozen during RL)
    family: Any = None                           # the Family that loaded it (stamped by load_flow_model; a builder's
                                                 # model may name its own): its LoRA targets and LoRA pipeline are
                                                 # read there, by training and by `mmrl plan` alike
    prediction: str = "velocity"                 # what the transformer outputs: "velocity" | "sample"
    call: Callable = sd3_call                    # (transformer, x, sigma, enc, pooled) -> output like x
    schedule: Callable[[int, float], torch.Tensor] = static_schedule  # (steps, sampler.shift) -> sigmas [S + 1]
    transformer_2: torch.nn.Module | None = None  # Wan2.2 A14B: the low-noise expert, used below `boundary`
    boundary: float | None = None                # sigma at which transformer_2 takes over (boundary_ratio)
    lockstep: Callable[[list[bool]], list[bool]] | None = None  # two experts under several processes: this call's
                                                 # need of each expert -> the experts it runs, the same on every rank
                                                 # (expert_lockstep; see _forward)
    cfg_grad: str = "full"                       # the gradient through CFG: full | cond (unconditional branch detached)
    encode_latents: Callable | None = None       # images [N, 3, sH, sW] in [-1, 1] -> x0 latents [N, *latent_shape]
                                                 # (VAE encode; offline data: preference pairs)
    image_scale: int = 1                         # s: output pixels per latent cell (the VAE's spatial factor)
    guide: Callable | None = None                # (v_u, v_c, w) -> guided v; None = v_u + w (v_c - v_u) (Qwen-Image:
                                                 # its pipeline's "true CFG", renormalized to v_c's norm)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, enc: torch.Tensor, pooled: torch.Tensor,
                 cfg_scale: float = 1.0, neg: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Guided velocity. x: [N, C, H, W]; sigma: [N]; enc: [N, L, D]; pooled: [N, P];
        neg: (enc, pooled) of the empty prompt, [N, L, D] and [N, P], required when cfg_scale != 1. The value is
        v_u + w (v_c - v_u) either way; `cfg_grad` says whether its gradient goes through v_u (full) or not (cond)."""
        if cfg_scale == 1.0:
            return self._forward(x, sigma, enc, pooled)
        if neg is None:
            raise ValueError("cfg_scale != 1 needs the unconditional (empty-prompt) embeddings")
        if self.cfg_grad == "cond" and torch.is_grad_enabled():
            # Flow-GRPO's gradient, d v / d theta = w d v_c / d theta: the unconditional branch runs without autograd,
            # so its activations are never stored and no backward runs through it (benchmarks/bench_cfg_grad.py)
            with torch.no_grad():
                v_u = self._forward(x, sigma, neg[0], neg[1])
            v_c = self._forward(x, sigma, enc, pooled)
            return v_u + cfg_scale * (v_c - v_u) if self.guide is None else self.guide(v_u, v_c, cfg_scale)
        v = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([neg[0], enc]),
                          torch.cat([neg[1], pooled]))  # one batched forward: sampling, or cfg_grad=full
        v_u, v_c = v.chunk(2)
        return v_u + cfg_scale * (v_c - v_u) if self.guide is None else self.guide(v_u, v_c, cfg_scale)

    def initial_noise(self, seeds: list[int], device="cpu") -> torch.Tensor:
        """[N, C, H, W] standard normal noise, one generator per sample so a sample never depends on its batch."""
        return torch.stack([torch.randn(self.latent_shape, generator=torch.Generator().manual_seed(int(s)))
                            for s in seeds]).to(device)

    def encode(self, texts: list[str], images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(enc [B, L, D], pooled [B, P]) of texts, with each row's conditioning images when the family takes them."""
        return self.encode_prompts(texts) if images is None else self.encode_prompts(texts, images)

    def negative(self, n: int, images: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(enc [n, L, D], pooled [n, P]) of the empty prompt (with each row's conditioning images, if any)."""
        if images is not None:
            return self.encode([""] * n, images)
        enc, pooled = self.encode_prompts([""])
        return enc.expand(n, -1, -1), pooled.expand(n, -1)

    @torch.no_grad()
    def generate(self, texts: list[str], seeds: list[int], num_steps: int = 16, cfg_scale: float = 4.0,
                 shift: float = 1.0, encoded: tuple | None = None, images: list | None = None) -> torch.Tensor:
        """ODE samples decoded to images [N, 3, H, W] in [-1, 1]. encoded: (enc, pooled, neg or None) already
        computed by the caller (a policy whose text encoders wait on the CPU), else the prompts (and each row's
        conditioning `images`) are encoded here."""
        from mmrl.sampling.flow_sde import run_chain

        device = next(self.transformer.parameters()).device
        if encoded is None:
            enc, pooled = self.encode(texts, images)
            neg = self.negative(len(texts), images) if cfg_scale != 1.0 else None
        else:
            enc, pooled, neg = encoded
        sigmas = self.schedule(num_steps, shift)
        traj = run_chain(lambda x, s: self.velocity(x, s, enc, pooled, cfg_scale, neg),
                         self.initial_noise(seeds, device), sigmas, ["ode"] * num_steps, 0.0, record=False)
        return self.decode(traj.latents[:, -1])

    def _forward(self, x, sigma, enc, pooled):
        """One transformer forward (rows at sigma >= boundary on transformer, the rest on transformer_2). A call
        runs the experts its rows need. In `lockstep` (several processes, where an expert's call may be a collective:
        DDP's reducer in a backward that synchronizes, FSDP2's all-gather always, and ranks may hold rows at different
        sigmas: training, forward-process noise levels) it runs the experts `lockstep` names, the same on every rank
        and in one order: one without rows here runs one row whose output enters the result times 0 (its parameters
        get zero gradients, as DDP's reducer expects). A sampling step's rows share its sigma on every rank, so the
        ranks agree on one expert and no idle row runs."""
        if self.transformer_2 is None:
            return self._expert(self.transformer, x, sigma, enc, pooled)
        high = sigma >= self.boundary                                                    # [N]
        need = [bool(high.any()), not bool(high.all())]
        run = need if self.lockstep is None else self.lockstep(need)
        if need == run and sum(run) == 1:
            return self._expert(self.transformer if need[0] else self.transformer_2, x, sigma, enc, pooled)
        out, unused = x.new_zeros(x.shape, dtype=torch.float32), 0.0
        for expert, rows, runs in ((self.transformer, high.nonzero().squeeze(1), run[0]),
                                   (self.transformer_2, (~high).nonzero().squeeze(1), run[1])):
            if not runs:
                continue
            if len(rows):
                out = out.index_put((rows,), self._expert(expert, x[rows], sigma[rows], enc[rows], pooled[rows]))
            else:
                unused = unused + 0.0 * self._expert(expert, x[:1], sigma[:1], enc[:1], pooled[:1]).sum()
        return out + unused  # differentiable

    def _expert(self, transformer, x, sigma, enc, pooled):
        # sigma stays fp32, as diffusers pipelines pass their timesteps: each model casts its time embedding itself,
        # and bf16 would round Wan's t = 1000 * sigma (937.5 -> 936)
        dtype = compute_dtype(transformer)
        out = self.call(transformer, x.to(dtype), sigma, enc.to(dtype), pooled.to(dtype))
        return velocity_from_prediction(out.float(), x, sigma, self.prediction)


def expert_lockstep(parallel: str, dist) -> Callable[[list[bool]], list[bool]]:
    """FlowModel.lockstep of two experts trained under `parallel` (ddp | fsdp | hsdp) by `dist` (mmrl.parallel.distributed):
    the experts a training call runs on every rank, given this rank's need. A backward that synchronizes gradients
    runs both under DDP and HSDP (DDP's reducer waits for every parameter; HSDP all-reduces across nodes the shards
    every backward of the step accumulated); otherwise FSDP2 and HSDP run those some rank needs (each call
    all-gathers; one decision per call), DDP this rank's own (no collective runs)."""
    def run(need: list[bool]) -> list[bool]:
        if torch.is_grad_enabled() and dist.syncs and parallel != "fsdp":
            return [True, True]
        return need if parallel == "ddp" else dist.any_rank(need)
    return run


def compute_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype a transformer computes in, which its inputs take: diffusers' rule (ModelMixin.dtype, what its own
    pipelines cast latents to), the first floating parameter outside `_keep_in_fp32_modules`. Not simply the first
    parameter: diffusers keeps Wan's scale_shift_table (its first), norms and time embedder in fp32 in a bf16 model,
    and fp32 inputs then meet the bf16 patch embedding wherever no autocast runs (evaluation). A DDP wrapper is
    looked through (its parameter names gain a `module.` prefix, the kept names still match)."""
    inner = getattr(transformer, "module", transformer)
    keep = getattr(inner, "_keep_in_fp32_modules", None) or ()
    for name, p in inner.named_parameters():
        if p.is_floating_point() and not any(k in name for k in keep):
            return p.dtype
    return next(transformer.parameters()).dtype


EXPERTS = ("transformer", "transformer_2")  # the trained networks a FlowModel may have (Wan2.2: two experts)
PREDICTIONS = ("velocity", "sample")
SIGMA_MIN_X_PRED = 0.05  # x-prediction: v = (x_t - x0_hat) / max(sigma, 0.05), JiT's clip of 1 / t


def velocity_from_prediction(out: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, prediction: str) -> torch.Tensor:
    """The flow velocity v = eps - x0 from a transformer output. out, x: [N, C, H, W]; sigma: [N]."""
    if prediction == "velocity":
        return out
    if prediction == "sample":
        return (x.float() - out) / sigma.float().clamp(min=SIGMA_MIN_X_PRED).view(-1, *([1] * (x.dim() - 1)))
    raise ValueError(f"unknown prediction {prediction!r}; valid: {PREDICTIONS}")
