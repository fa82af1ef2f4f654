"""Worker for tests/test_context_parallel.py: a tiny Wan transformer with diffusers context parallelism (gloo, CPU)
against the same computation in one process.

    torchrun --standalone --nproc_per_node P tests/workers/cp_worker.py OUT --model wan21|wan22 --cp CP [--kind K]

Every rank builds the same weights and inputs (seed 0) and first computes the one-process reference on a copy of the
transformer (no collective touches it). Then, with the transformer split over a (dp, cp) mesh, each dp row takes its
own rows of the batch (the cp ranks of a row the same rows), and per rank:
  sampling: a 2-step Flow-GRPO SDE chain (velocity -> mmrl.sampling.flow_sde.step, the same generator on every rank);
  training: the log-prob of step 0's stored transition under the model (flow_sde.step_mean_std + gaussian_log_prob),
            loss = -mean(adv * log_prob), backward, `reduce_gradients` (sum over cp, mean over dp);
  memory:   bytes of the tensors autograd saves during the training forward (saved_tensors_hooks, one count per
            storage): the transformer call alone and with the log-prob after it; reference and cp run.
Rank 0 writes OUT (json): max abs differences against the reference and the saved bytes.
"""

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

N_ROWS = 2  # batch rows; split over dp
SIGMAS = torch.tensor([1.0, 0.75, 0.5])  # 2 steps
NOISE_LEVEL = 0.7


def build(model: str):
    """wan21: tinier Wan2.1 T2V (16 latent channels, 1-D timestep, mmrl's tiny_pipelines shape).
    wan22: tiny Wan2.2 TI2V-5B layout (48 latent channels, per-token timestep [N, S] as its pipeline passes with
    expand_timesteps; the A14B experts are two Wan2.1-shaped transformers, each enabled on its own)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    ch, heads, head_dim = (16, 2, 12) if model == "wan21" else (48, 4, 8)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=ch, out_channels=ch, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def velocity(transformer, x, sigma, enc, per_token: bool):
    """x [N, C, F', H, W], sigma [N], enc [N, L, 32] -> v [N, C, F', H, W] (fp32)."""
    t = sigma * 1000
    if per_token:  # Wan2.2 TI2V: one timestep per video token, [N, S]
        from mmrl.parallel.context_parallel import sequence_length

        t = t[:, None].expand(-1, sequence_length(transformer, x.shape))
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=enc, return_dict=False)[0].float()


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward inside the `with` block."""

    def __init__(self):
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.seen:
            self.seen.add(s.data_ptr())
            self.bytes += s.nbytes()
        return t

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def run(transformer, x, enc, adv, per_token, first_row=0, reduce=None):
    """The sampling chain and one training backward over rows first_row.. of the batch; returns tensors to
    compare and the saved bytes. A row's noise comes from its own generator (seeded by step and global row)."""
    from mmrl.sampling.flow_sde import gaussian_log_prob, step, step_mean_std

    n = x.shape[0]
    chain, log_probs = [x], []
    with torch.no_grad():
        for i in range(len(SIGMAS) - 1):
            sigma, sigma_next = SIGMAS[i].expand(n), SIGMAS[i + 1].expand(n)
            v = velocity(transformer, chain[-1], sigma, enc, per_token)
            gens = [torch.Generator().manual_seed(100 * i + first_row + r) for r in range(n)]
            out = step("flow_grpo", chain[-1], v, sigma, sigma_next, NOISE_LEVEL, float(SIGMAS[1]), generator=gens)
            chain.append(out.next)
            log_probs.append(out.log_prob)
        v0 = velocity(transformer, x, SIGMAS[0].expand(n), enc, per_token)
    transformer.zero_grad(set_to_none=True)
    with SavedBytes() as saved:
        v = velocity(transformer, x, SIGMAS[0].expand(n), enc, per_token)
        in_transformer = saved.bytes
        mean, std = step_mean_std("flow_grpo", x, v, SIGMAS[0].expand(n), SIGMAS[1].expand(n), NOISE_LEVEL,
                                  float(SIGMAS[1]))
        lp = gaussian_log_prob(chain[1], mean, std)  # [N], mean over latent elements
    (-(adv * lp).mean()).backward()
    if reduce is not None:
        reduce(transformer.parameters())
    return dict(velocity=v0, latents=torch.stack(chain[1:]), sample_log_prob=torch.stack(log_probs),
                train_log_prob=lp.detach(), grads=[p.grad.clone() for p in transformer.parameters()],
                saved_bytes=saved.bytes, saved_bytes_transformer=in_transformer)


def unguarded(transformer, x, enc, per_token, args):
    """What diffusers itself does with this layout on CPU: {"error": message or null}."""
    from unittest import mock

    from diffusers import ContextParallelConfig

    degree = dict(ring_degree=args.cp) if args.kind == "ring" else dict(ulysses_degree=args.cp)
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        transformer.enable_parallelism(config=ContextParallelConfig(**degree))
    try:
        velocity(transformer, x, torch.ones(len(x)), enc, per_token)
        error = None
    except Exception as e:  # the finding to report, whatever its type
        error = f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"error": error}, f)
    dist.barrier()  # no rank tears the group down while another still talks to it (an abort at exit otherwise)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="wan21", choices=("wan21", "wan22"))
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--kind", default="ulysses")
    p.add_argument("--frames", type=int, default=4, help="latent frames F'")
    p.add_argument("--size", type=int, default=8, help="latent height = width (tokens S = F' (size / 2)^2)")
    p.add_argument("--unguarded", action="store_true",
                   help="call diffusers' enable_parallelism directly (no mmrl checks), run one forward, write its error")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from mmrl.parallel.context_parallel import build_mesh, enable_context_parallel, reduce_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    transformer = build(args.model)
    per_token = args.model == "wan22"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_ROWS, transformer.config.in_channels, args.frames, args.size, args.size, generator=g)
    enc = torch.randn(N_ROWS, 6, 32, generator=g)
    adv = torch.tensor([1.0, -0.5])

    if args.unguarded:
        return unguarded(transformer, x, enc, per_token, args)
    ref = run(copy.deepcopy(transformer), x, enc, adv, per_token)  # one process, whole batch

    mesh = build_mesh(args.cp)
    enable_context_parallel(transformer, args.cp, mesh, kind=args.kind)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp_rank * N_ROWS // dp, (dp_rank + 1) * N_ROWS // dp)  # the same rows on every cp rank of a row
    got = run(transformer, x[rows], enc[rows], adv[rows], per_token, rows.start,
              reduce=lambda params: reduce_gradients(params, mesh))
    # the mean over a dp row's rows of a [N] loss: rows of equal count, so the dp mean is the batch mean
    diff = {k: (got[k] - ref[k][..., rows] if k == "sample_log_prob" else got[k] - ref[k][rows]).abs().max().item()
            for k in ("velocity", "train_log_prob")}
    diff["latents"] = (got["latents"] - ref["latents"][:, rows]).abs().max().item()
    diff["sample_log_prob"] = (got["sample_log_prob"] - ref["sample_log_prob"][:, rows]).abs().max().item()
    diff["grads"] = max((a - b).abs().max().item() for a, b in zip(got["grads"], ref["grads"]))
    diff["grad_scale"] = max(b.abs().max().item() for b in ref["grads"])
    report = dict(world=world, dp=dp, cp=args.cp, kind=args.kind, model=args.model, max_abs_diff=diff,
                  saved_bytes_one_process=ref["saved_bytes"], saved_bytes_cp=got["saved_bytes"],
                  saved_bytes_transformer_one_process=ref["saved_bytes_transformer"],
                  saved_bytes_transformer_cp=got["saved_bytes_transformer"],
                  rows_per_rank=rows.stop - rows.start)
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(reports, f, indent=1)
        print(json.dumps(reports[0]))
    dist.barrier()  # no rank tears the group down while another still talks to it (an abort at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
