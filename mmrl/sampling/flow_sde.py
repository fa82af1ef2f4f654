"""Pure flow-matching step functions with exact Gaussian log-probs (Flow-GRPO, DanceGRPO, CPS, ODE).

Convention (docs/algorithms.md §1): `x_sigma = (1 - sigma) * x0 + sigma * eps`, velocity `v ~ eps - x0`,
sigma goes from ~1 (noise) to 0 (data), `dt = sigma_next - sigma < 0`. Everything here is computed in fp32.

Every step returns `StepOut(next, mean, std, log_prob)`:
  next     [N, *D]  the sampled x_{t+1} (= mean for the ODE)
  mean     [N, *D]  the Gaussian mean the sample was drawn around
  std      [N]      the Gaussian std (scalar per sample; 0 for the ODE)
  log_prob [N]      log N(next; mean, std^2), REDUCED OVER ELEMENTS: `reduce="mean"` averages the per-element
                    log-density over the latent elements (Flow-GRPO reference; its PPO clip ranges 1e-4..2e-6
                    assume this scale), `reduce="sum"` gives the true joint log-density. 0 for the ODE.

The log-prob of a stored transition under new weights is `gaussian_log_prob(next, new_mean, std, reduce)`,
the same function the sampler used, which is what makes the on-policy ratio exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch
from tqdm import tqdm

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOut:
    next: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, 1, ..., 1] to broadcast against like [N, *D]; python floats pass through."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.dim() - 1))) if t.dim() == 1 else t


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """log N(x; mean, std^2 I) reduced over all non-batch dims. x, mean: [N, *D]; std: [N] or scalar -> [N]."""
    s = _bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - LOG_SQRT_2PI  # [N, *D]
    lp = lp.flatten(1)
    if reduce == "mean":
        return lp.mean(1)
    if reduce == "sum":
        return lp.sum(1)
    raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")


def flow_grpo_std_scale(sigma: torch.Tensor, noise_level: float, sigma_max: float) -> torch.Tensor:
    """Flow-GRPO diffusion coefficient s = a * sqrt(sigma / (1 - sigma)); at sigma = 1 the denominator uses
    sigma_max (the first sigma below 1) to avoid the pole."""
    denom = torch.where(sigma >= 1.0, torch.full_like(sigma, 1 - sigma_max), 1 - sigma)
    return noise_level * torch.sqrt(sigma / denom)


def sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Mean of the Flow-GRPO / DanceGRPO SDE step: x + [v + s^2/(2 sigma) (x + (1 - sigma) v)] dt.
    x, v: [N, *D]; sigma, dt, s: [N]."""
    sigma, dt, s = _bcast(sigma, x), _bcast(dt, x), _bcast(s, x)
    return x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt


SDE_KINDS = ("flow_grpo", "dance", "cps")  # sampler.kind (training); "ode" only with forward-process losses


def step_mean_std(kind: str, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                  noise_level: float, sigma_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [N, *D], std [N]) of one step of sampler `kind` from x at sigma to sigma_next.

    kind: "ode" (Euler, std 0), "flow_grpo" (s = a sqrt(sigma/(1-sigma))), "dance" (s = noise_level constant),
          "cps" (coefficients-preserving: std = sigma_next sin(a pi / 2)).
    """
    x, v = x.float(), v.float()
    sigma, sigma_next = sigma.float(), sigma_next.float()
    dt = sigma_next - sigma
    if kind == "ode" or noise_level == 0:
        return x + v * _bcast(dt, x), torch.zeros_like(sigma)
    if kind in ("flow_grpo", "dance"):
        s = flow_grpo_std_scale(sigma, noise_level, sigma_max) if kind == "flow_grpo" else torch.full_like(sigma, noise_level)
        return sde_mean(x, v, sigma, dt, s), s * torch.sqrt(-dt)
    if kind == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        x0 = x - _bcast(sigma, x) * v
        x1 = x + _bcast(1 - sigma, x) * v
        mean = x0 * _bcast(1 - sigma_next, x) + x1 * _bcast(torch.sqrt(sigma_next**2 - std**2), x)
        return mean, std
    raise ValueError(f"unknown sampler {kind!r}; valid: ode, flow_grpo, dance, cps")


def step(kind: str, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
         noise_level: float, sigma_max: float, generator: torch.Generator | list | None = None,
         reduce: str = "mean", std_scale: float = 1.0) -> StepOut:
    """Sample one step and return it with its log-prob. Shapes as in the module docstring. std_scale widens the
    noise (BranchGRPO's split noise); the returned std and log-prob are those of the density actually sampled."""
    mean, std = step_mean_std(kind, x, v, sigma, sigma_next, noise_level, sigma_max)
    std = std * std_scale
    if bool((std == 0).all()):
        return StepOut(mean, mean, std, torch.zeros_like(std))
    if isinstance(generator, (list, tuple)):  # one generator per row: a row's noise never depends on its batch
        noise = torch.stack([torch.randn(mean.shape[1:], generator=g, device=g.device, dtype=mean.dtype)
                             for g in generator]).to(mean.device)
    else:
        noise = torch.randn(mean.shape, generator=generator, device="cpu" if generator is None else generator.device,
                            dtype=mean.dtype).to(mean.device)
    nxt = mean + _bcast(std, mean) * noise
    return StepOut(nxt, mean, std, gaussian_log_prob(nxt, mean, std, reduce))



@dataclass
class Trajectory:
    """A denoising chain. S steps; x_0 is noise, x_S the sample."""

    latents: torch.Tensor   # [N, S + 1, *D]  x_0 .. x_S
    log_prob: torch.Tensor  # [N, S]          log-prob of each transition (0 on ODE steps)
    mean: torch.Tensor      # [N, S, *D]      mean each transition was drawn around
    std: torch.Tensor       # [N, S]          its std (0 on ODE steps)


@torch.no_grad()
def dpm2m_step(x: torch.Tensor, x0: torch.Tensor, x0_prev: torch.Tensor | None, sigma_prev: float | None,
               sigma: float, sigma_next: float) -> torch.Tensor:
    """One DPM-Solver++(2M) ODE step (Lu et al. 2022, arXiv 2211.01095, data prediction; docs/algorithms.md §11) in the
    flow-matching convention alpha = 1 - sigma, lambda = log(alpha / sigma). x0 = x - sigma v is this step's data
    prediction, x0_prev the previous step's (at sigma_prev):

        h = lambda_next - lambda,  r = (lambda - lambda_prev) / h,  D = (1 + 1/(2r)) x0 - x0_prev / (2r)
        x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D

    First order (D = x0, which is exactly the Euler step of the velocity) without a usable previous prediction
    (first step, previous sigma 1) and on the last step to sigma 0, as diffusers' solver does."""
    if x0_prev is None or sigma_prev is None or sigma_prev >= 1.0 or sigma_next <= 0.0 or sigma >= 1.0:
        return x + (sigma_next - sigma) / sigma * (x - x0)  # = x + v dt
    lam = lambda s: math.log((1 - s) / s)  # noqa: E731
    h = lam(sigma_next) - lam(sigma)
    r = (lam(sigma) - lam(sigma_prev)) / h
    d = (1 + 1 / (2 * r)) * x0 - x0_prev / (2 * r)
    return sigma_next / sigma * x - (1 - sigma_next) * math.expm1(-h) * d


def strided_schedule(sigmas: torch.Tensor, kinds: list[str], stride: int) -> tuple[torch.Tensor, list[str], list[int]]:
    """MixGRPO-Flash: the ODE runs outside the SDE steps take every `stride`-th sigma of the schedule (their last
    sigma kept), the SDE steps keep theirs. Returns (sigmas' [S' + 1], kinds' [S'], pos): pos[i] = the index in the
    new schedule of original step i when it is kept (every SDE step is), else -1."""
    keep, i, n = [0], 0, len(kinds)
    while i < n:
        if kinds[i] != "ode":
            i += 1
        else:
            end = i
            while end < n and kinds[end] == "ode":
                end += 1
            i = min(i + stride, end)
        keep.append(i)
    pos = [-1] * n
    for j, k in enumerate(keep[:-1]):
        pos[k] = j
    return sigmas[keep], [kinds[k] for k in keep[:-1]], pos  # a strided jump starts at an ODE step


def window_in(steps: list[int], size: int, start_range: list[int], generator: torch.Generator,
              slide: int | bool = False) -> list[int]:
    """A window of `size` consecutive steps of `steps` (0 or more than there are: all of them), its start drawn over
    start_range [lo, hi) counted from steps[0] (hi -1: the last start that fits), or, with `slide` (MixGRPO's
    sliding window: the number of moves so far), lo + slide capped at the last start. The draw is taken either way,
    so the generator's stream does not depend on the schedule."""
    size = min(size or len(steps), len(steps))
    lo, hi = start_range
    top = len(steps) - size + 1  # starts that fit
    hi = top if hi < 0 else min(hi, top)
    lo = min(lo, max(hi - 1, 0))
    draw = int(torch.randint(0, hi - lo, (1,), generator=generator)) if hi > lo else 0
    start = min(lo + slide, max(hi - 1, lo)) if slide is not False else lo + draw
    return steps[start:start + size]


def run_chain(velocity, x: torch.Tensor, sigmas: torch.Tensor, kinds: list[str], noise_level: float,
              generator: torch.Generator | None = None, reduce: str = "mean", record: bool = True,
              progress: bool = False, ode_solver: str = "euler") -> Trajectory:
    """Integrate from sigmas[0] to sigmas[-1]. velocity(x [N, *D], sigma [N]) -> v [N, *D].

    kinds[i] in {"ode", "flow_grpo", "dance", "cps"} is the sampler of step i (len(kinds) = len(sigmas) - 1);
    ode_solver ("euler" | "dpm2m") integrates the "ode" steps. With record=False only the final sample is kept
    (latents has S + 1 = 2 entries: x_0 and x_S).
    """
    n = x.shape[0]
    sigma_max = float(sigmas[1]) if len(sigmas) > 1 else 0.0
    xs, lps, means, stds = [x], [], [], []
    x0_prev = sigma_prev = None
    for i, kind in enumerate(tqdm(kinds, desc="rollout", leave=False, disable=not progress)):
        sig = sigmas[i].expand(n).to(x.device)
        sig_next = sigmas[i + 1].expand(n).to(x.device)
        v = velocity(x, sig)
        if ode_solver == "dpm2m":  # the data prediction of every step feeds the next ODE step's second order
            s = float(sigmas[i])
            x0 = x.float() - s * v.float()
        if kind == "ode" and ode_solver == "dpm2m":
            nxt = dpm2m_step(x.float(), x0, x0_prev, sigma_prev, s, float(sigmas[i + 1]))
            out = StepOut(nxt, nxt, torch.zeros_like(sig), torch.zeros_like(sig))
        else:
            out = step(kind, x, v, sig, sig_next, noise_level, sigma_max, generator, reduce)
        if ode_solver == "dpm2m":
            x0_prev, sigma_prev = x0, s
        x = out.next
        if record:
            xs.append(x)
            lps.append(out.log_prob)
            means.append(out.mean)
            stds.append(torch.as_tensor(out.std).expand(n))
    if not record:
        return Trajectory(torch.stack([xs[0], x], 1), torch.zeros(n, 0), torch.zeros(n, 0), torch.zeros(n, 0))
    return Trajectory(torch.stack(xs, 1), torch.stack(lps, 1), torch.stack(means, 1), torch.stack(stds, 1))
