"""TempFlow-GRPO per-step branching rollouts for flow policies (arXiv 2508.04324; docs/algorithms.md §4).

Sampling (`run_branches`). Each prompt runs one Euler ODE trunk from its own noise. At every branch step j (the
SDE window: sampler.sde_window_size 0 = every trainable step) the trunk's velocity at x_j, evaluated once, gives
K = sampler.branch_children SDE children x_{j+1}^k, each finished by ODE to a sample; the trunk then takes its ODE
step. A prompt's rows are its K x J children, branch-step-major: row i * K + k is child k of branch step i.

Training (`step_credit`). A child has one action, its SDE step from the trunk. Its rewards differ from its
siblings' only through that step's noise, so its advantage is group-relative among the K children of the same
prompt and step (the configured estimator and reward aggregation): every branch step gets its own advantage in one
iteration, where a chain rollout credits a window of steps with one terminal advantage.

Transformer rows per prompt: max(J) + 1 on the trunk, then sum_j K (S - 1 - j) to finish the children (x2 with
CFG); S = sampler.num_steps. The trunk's own sample is never decoded or scored.

Compared with the official code (Shredded-Pork/TempFlow-GRPO: flow_grpo/diffusers_patch/
sd3_pipeline_with_logprob_perstep.py, sd3_sde_with_logprob_perstep.py, scripts/train_sd3_pr.py):
- it branches at every step but the last (K = 6 hard-coded); here the branch steps are the SDE window;
- its stat tracker groups a step's children by prompt text over the process's batches, so when one process holds
  several trunks of a prompt (sample.num_image_per_prompt copies) their children share one group; here a group is
  the K children of one trunk, so a step's advantage never mixes in another trunk's initial noise;
- its trunk runs every step, the last included; here the trunk stops after the last branch step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from mmrl.algorithms.advantages import group_credit
from mmrl.sampling.flow_sde import run_chain, step


@dataclass
class Branches:
    """B prompts, J branch steps, K children each; rows n = B * J * K in the rollout's order (prompt, step, child)."""

    latents: torch.Tensor       # [n, *D]  the trunk's x_j the child branched from
    next_latents: torch.Tensor  # [n, *D]  the child's x_{j+1}
    mean: torch.Tensor          # [n, *D]  the Gaussian mean it was drawn around
    std: torch.Tensor           # [n]      its std
    log_prob: torch.Tensor      # [n]      log N(x_{j+1}; mean, std^2), reduced as the sampler's steps
    final: torch.Tensor         # [n, *D]  the child finished by ODE
    step: torch.Tensor          # [n] long its branch step j
    rows: int                   # transformer rows evaluated (the trunk's and the children's; CFG not counted)


@torch.no_grad()
def run_branches(velocity, x: torch.Tensor, sigmas: torch.Tensor, steps: list[int], children: int, kind: str,
                 noise_level: float, generators: list[torch.Generator], reduce: str = "mean",
                 progress: bool = False) -> Branches:
    """Trunks from x [B, *D] over sigmas [S + 1]; velocity(x [M, *D], sigma [M], prompt [M] long) -> v [M, *D].
    steps: the branch steps (distinct, < S - 1); generators: one per child row (B * J * K, in the rows' order), so a
    child's noise never depends on its batch or on which process samples it."""
    b, k, order = x.shape[0], children, sorted(steps)
    if order != list(dict.fromkeys(steps)) or not order or order[-1] >= len(sigmas) - 2:
        raise ValueError(f"branch steps {steps} must be distinct, increasing and below the last step {len(sigmas) - 2}")
    j_of = {j: i for i, j in enumerate(order)}
    sigma_max = float(sigmas[1])
    prompt = torch.arange(b, device=x.device)
    parts, rows = [None] * len(order), 0
    for i in tqdm(range(order[-1] + 1), desc="trunk", leave=False, disable=not progress):
        sig, sig_next = sigmas[i].expand(b).to(x.device), sigmas[i + 1].expand(b).to(x.device)
        v = velocity(x, sig, prompt)                                                    # [B, *D]
        rows += b
        if i in j_of:  # K children of every trunk: one SDE step from x_i with the trunk's velocity
            idx = [(p * len(order) + j_of[i]) * k + c for p in range(b) for c in range(k)]
            rep = lambda t: t.repeat_interleave(k, 0)                                   # noqa: E731 [B*K, ...]
            out = step(kind, rep(x), rep(v), rep(sig), rep(sig_next), noise_level, sigma_max,
                       [generators[r] for r in idx], reduce)
            done = run_chain(lambda y, s: velocity(y, s, prompt.repeat_interleave(k)), out.next, sigmas[i + 1:],
                             ["ode"] * (len(sigmas) - 2 - i), noise_level, record=False)
            rows += b * k * (len(sigmas) - 2 - i)
            parts[j_of[i]] = (rep(x), out, done.latents[:, -1], torch.full((b * k,), i))
        x = x + v * (sig_next - sig).view(-1, *([1] * (x.dim() - 1)))                  # the trunk's Euler step
    # parts[step][prompt * K + child] -> rows (prompt, step, child)
    order_rows = torch.tensor([[s * b * k + p * k + c for s in range(len(order)) for c in range(k)] for p in range(b)]
                              ).flatten()
    cat = lambda f: torch.cat([f(p) for p in parts])[order_rows]                       # noqa: E731
    return Branches(latents=cat(lambda p: p[0]), next_latents=cat(lambda p: p[1].next), mean=cat(lambda p: p[1].mean),
                    std=cat(lambda p: torch.as_tensor(p[1].std).expand(b * k)), log_prob=cat(lambda p: p[1].log_prob),
                    final=cat(lambda p: p[2]), step=cat(lambda p: p[3]), rows=rows)


def step_credit(rewards: dict, weights: dict | None, rollout, valid: torch.Tensor, cfg, iteration: int):
    """The `step_branch` credit assignment (CREDIT_ASSIGNMENTS): a child's advantage [N] from the group of its
    prompt's children at its branch step (rollout.group_id x step_index), with the configured aggregation and
    estimator; the statistics of whole prompts are logged beside them as the `group` credit logs them."""
    step_index = rollout.extras["step_index"][:, 0].long()                              # [N]
    sub = rollout.group_id * (int(step_index.max()) + 1) + step_index                   # [N] (prompt, step)
    sub = torch.where(rollout.group_id >= 0, sub, torch.full_like(sub, -1))             # padding rows stay -1
    return group_credit(rewards, weights, _Groups(sub), valid, cfg, iteration)


step_credit.reads_extras = ("step_index",)  # gathered across ranks with the rewards


@dataclass
class _Groups:
    group_id: torch.Tensor  # what group_credit reads of a rollout
