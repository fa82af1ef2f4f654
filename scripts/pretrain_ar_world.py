"""Pretrain the embedded autoregressive shapes world (issue 47): a small JanusForConditionalGeneration (transformers'
class, config in code) whose VQ model turns a 36 x 36 shapes image into 9 x 9 = 81 codes and whose Llama language
model generates those codes after a prompt; the janus policy (mmrl/policy/janus.py) loads the saved folder as it
loads Janus-Pro. Reproduces the committed base:

    python scripts/pretrain_ar_world.py --minutes 18 --vq-minutes 4 --threads 1 --out tasks/assets/shapes-ar-base

and the equal-time pretraining control of a 16-minute GRPO run on it (its language model trained on, VQ model kept):

    python scripts/pretrain_ar_world.py --init tasks/assets/shapes-ar-base --minutes 16 --threads 1 --seed S \
        --cfg-scales 1.5 --out runs/ar_control_16min_sS/model

Both phases train on images rendered from the world's TRAIN texts (held-out texts are never seen; categories drawn
equally, as scripts/pretrain_world.py draws them), and the clock (`--minutes`, VQ then language model) excludes the
evaluations:
1. The VQ model (encoder, codebook of unit vectors, decoder; a position takes the code of largest cosine, as in
   LlamaGen's tokenizer, arXiv 2406.06525, the one Janus uses). `--vq patches` (the committed base): the codes are
   the world's 85 distinct 4 x 4 patches (objects sit centered in 12 px cells, so a patch is always one of them);
   the encoder learns to pick a patch's code (cross-entropy over its cosines with the codebook) and the decoder to
   reconstruct the image from the codes (MSE). `--vq vae`: a VQ-VAE (arXiv 1711.00937) with 256 l2-normalized codes,
   the reconstruction MSE + the codebook term |sg(z) - e|^2 + 0.25 |z - sg(e)|^2 (commitment), straight-through
   gradients and dead-code restarts. Both reconstruct shapes the detector reads (100 % and 99.6 % strict), but the
   VQ-VAE's encoder sees the whole image and its decoder decodes the gray background from any of ~150 codes: a
   position's code carries 4.0 nats beyond its patch, noise the language model then has to predict
   (docs/results.md, "An autoregressive shapes world"). The codebook is saved normalized: transformers'
   `JanusVQVAE.encode` (nearest code by Euclidean distance) then picks the codes trained here, and its `decode`
   (which normalizes each code) decodes them as trained.
2. The image-generation path (language model, generation embeddings, aligner and head: `ImageTokenLM`, the module
   the janus policy trains) by next-token cross-entropy on the 81 codes of `JanusVQVAE.encode` after Janus's
   image-generation prompt; `--cond-drop` of the prompts are replaced by the unconditional prompt of the policy's
   CFG sampler (every token but BOS and <begin_of_image> made pad), so classifier-free guidance has an
   unconditional model to push from.
Then the base is scored on `--eval-n` TRAIN prompts at each of `--cfg-scales` (the CFG scale is chosen here, never
on held-out texts: pretrain_info.json's cfg_scale) and, at that scale, on held-out prompts for the log.
Writes OUT (save_pretrained: safetensors, JanusProcessor) with pretrain_info.json, and OUT.log.jsonl beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

from mmrl.testing.janus import TEMPLATE, word_tokenizer

IMAGE, PATCH = 36, 4  # pixels; the VQ model's downsampling: 9 x 9 codes
# small: the committed base; tiny: --quick (a smoke test of the whole script in seconds)
SIZES = {
    "small": dict(hidden=128, layers=4, heads=4, vq_mult=[1, 1, 2], batch=32),
    "tiny": dict(hidden=32, layers=1, heads=2, vq_mult=[1, 1, 1], batch=4),
}
VAE_CODES = 256  # --vq vae's codebook (--vq patches: one code per patch of the world, 85)


def build_shapes_janus(size: dict, codes: int, seed: int = 0):
    """(JanusForConditionalGeneration, JanusProcessor), random init: a word-level tokenizer over the shapes
    vocabulary with Janus's special tokens and chat template; a Llama language model; a VQ model whose encoder
    downsamples 36 x 36 images by 4 (len(vq_mult) = 3 levels) to 81 codes (of `codes`) of 8 dims; the SigLIP tower
    at the smallest size its config takes (image generation never runs it)."""
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusImageProcessor, JanusProcessor

    from tasks import shapes

    words = sorted({w for p in shapes.all_prompts() for w in p.text.split()}) + [":"]
    tok = word_tokenizer(words)
    h, tokens = size["hidden"], (IMAGE // PATCH) ** 2
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=h, intermediate_size=2 * h,
                num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                num_key_value_heads=size["heads"], max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, image_size=IMAGE, patch_size=PATCH,
                  projection_dim=h, num_image_tokens=tokens, mlp_ratio=1.0, depth=1)
    # base_channels 32: the smallest the VQ model's GroupNorm(32 groups) takes; num_res_blocks 0: each level is its
    # (down / up) sampling conv alone, plus the middle block's two residual blocks and attention
    vq = dict(embed_dim=8, num_embeddings=codes, latent_channels=32, base_channels=32,
              channel_multiplier=size["vq_mult"], num_res_blocks=0, projection_dim=h, image_token_embed_dim=h,
              num_hidden_layers=2)
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                                                      image_token_id=tok.convert_tokens_to_ids("<image_placeholder>")))
    assert model.config.vq_config.num_patches ** 2 == tokens and 2 ** (len(size["vq_mult"]) - 1) == PATCH
    # what transformers' own generate(generation_mode="image") reads (tests/test_janus.py: hf_generate)
    gc = model.generation_config
    gc.bos_token_id, gc.pad_token_id = tok.bos_token_id, tok.pad_token_id
    gc.generation_kwargs = {"boi_token_id": tok.convert_tokens_to_ids("<begin_of_image>")}
    ip = JanusImageProcessor(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = JanusProcessor(image_processor=ip, tokenizer=tok, chat_template=TEMPLATE, num_image_tokens=tokens)
    return model, processor


class Data:
    """Training batches of the world's TRAIN texts, categories drawn equally: (texts, images [n, 3, 36, 36])."""

    def __init__(self, rng: random.Random):
        from tasks import shapes

        self.shapes, self.rng = shapes, rng
        groups: dict[str, list] = {}
        for p in shapes.prompts("train"):
            groups.setdefault(p.spec.category, []).append(p)
        self.groups = [groups[k] for k in sorted(groups)]

    def batch(self, n: int) -> tuple[list[str], torch.Tensor]:
        ps = [self.rng.choice(self.rng.choice(self.groups)) for _ in range(n)]
        return [p.text for p in ps], torch.stack([self.shapes.to_tensor(self.shapes.render(p.spec, IMAGE, self.rng))
                                                  for p in ps])


# ------------------------------------------------------------------------------------------------ VQ model
def patch_vocabulary() -> torch.Tensor:
    """The world's 4 x 4 patches [V, 48] (V = 85: the background, then 14 per color): every distinct patch of one
    object of each shape and color. Objects sit centered in 12 px cells of 3 x 3 patches, so a patch of a rendered
    image never straddles two objects and is always one of these."""
    from tasks import shapes

    rng = random.Random(0)
    imgs = [shapes.to_tensor(shapes.render(shapes.Spec("colors", (shapes.Obj(s, c),)), IMAGE, rng))
            for c in shapes.COLORS for s in shapes.SHAPES]
    found = torch.unique(patches(torch.stack(imgs)).flatten(0, 1), dim=0)               # [V, 48]
    background = (torch.tensor(shapes.BACKGROUND, dtype=torch.float32) / 127.5 - 1).repeat_interleave(PATCH ** 2)
    return torch.cat([background[None], found[(found - background).abs().amax(1) > 0]])


def patches(x: torch.Tensor) -> torch.Tensor:
    """The 4 x 4 patches [n, 81, 48] of images x [n, 3, 36, 36], row-major (the VQ model's token order)."""
    return x.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)


def patch_loss(vq, x: torch.Tensor, vocab: torch.Tensor, scale: float = 10.0):
    """(loss, stats, None, None) for --vq patches: each position's code is its patch's index in `vocab` [V, 48]; the
    encoder learns to pick it (cross-entropy over the scaled cosines of its output with the codebook), the decoder to
    reconstruct x [n, 3, H, W] from those codes (MSE, through JanusVQVAE.decode)."""
    target = torch.cdist(patches(x).flatten(0, 1), vocab).argmin(1)                    # [n * 81]
    z = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)                                # [n, 8, 9, 9]
    cos = z.permute(0, 2, 3, 1).flatten(0, 2) @ F.normalize(vq.quantize.embedding.weight, dim=1).T  # [n * 81, V]
    assign = F.cross_entropy(scale * cos, target)
    recon = F.mse_loss(vq.decode(target.view(len(x), -1)), x)
    stats = {"recon": recon.item(), "assign": assign.item(), "match": (cos.argmax(1) == target).float().mean().item()}
    return recon + assign, stats, None, None


def vae_loss(vq, x: torch.Tensor, vocab=None, beta: float = 0.25):
    """(loss, stats, codes [n * 81], z [n * 81, 8]) for --vq vae, a VQ-VAE on images x [n, 3, H, W] in [-1, 1]:
    reconstruction MSE + codebook + beta x commitment, l2-normalized codes (module docstring)."""
    z = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)                                # [n, 8, 9, 9]
    zf = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])                                  # [n * 81, 8]
    book = F.normalize(vq.quantize.embedding.weight, dim=1)                             # [K, 8]
    codes = (zf.detach() @ book.T).argmax(1)                                            # [n * 81]
    q = book[codes]
    codebook, commit = F.mse_loss(q, zf.detach()), F.mse_loss(zf, q.detach())
    q = (zf + (q - zf).detach()).view(z.shape[0], *z.shape[2:], -1).permute(0, 3, 1, 2)  # straight-through
    recon = F.mse_loss(vq.decoder(vq.post_quant_conv(q)), x)
    stats = {"recon": recon.item(), "codebook": codebook.item(), "commit": commit.item()}
    return recon + codebook + beta * commit, stats, codes, zf.detach()


DEAD_USE = 0.05  # --vq vae: a code used less than this many times per batch (an EMA) restarts


def train_vq(vq, data: Data, vocab: torch.Tensor, args, clock) -> list[dict]:
    """Trains the VQ model for args.vq_minutes (or args.vq_steps) with the --vq loss; returns log records. --vq vae:
    codes used less than DEAD_USE times per batch restart at random encoder outputs of the batch."""
    loss_fn = {"patches": patch_loss, "vae": vae_loss}[args.vq]
    vq.requires_grad_(True).train()
    opt = torch.optim.AdamW(vq.parameters(), lr=args.vq_lr, weight_decay=0.0)
    k = vq.quantize.embedding.num_embeddings
    use = torch.ones(k)
    step, records, start = 0, [], clock.minutes()
    while not clock.done(start, args.vq_minutes, step, args.vq_steps):
        _, x = data.batch(args.batch)
        loss, stats, codes, zf = loss_fn(vq, x, vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = args.vq_lr * min(1.0, (step + 1) / 50)
        opt.step()
        step += 1
        if codes is not None:
            use = 0.98 * use + 0.02 * torch.bincount(codes, minlength=k).float()
            if step % 25 == 0:
                dead = use < DEAD_USE
                with torch.no_grad():
                    vq.quantize.embedding.weight[dead] = zf[torch.randint(len(zf), (int(dead.sum()),))]
                use[dead] = 1.0
                stats["restarted"] = int(dead.sum())
        if step % 50 == 0 or step == 1 or clock.done(start, args.vq_minutes, step, args.vq_steps):
            print(f"vq step {step} loss {loss.item():.4f} {stats} {clock.minutes():.1f} min", flush=True)
            records.append({"phase": "vq", "step": step, "minutes": round(clock.minutes(), 2), "loss": loss.item(),
                            **stats})
    with torch.no_grad():  # unit codes: JanusVQVAE.encode's nearest code = the largest cosine trained above
        vq.quantize.embedding.weight.copy_(F.normalize(vq.quantize.embedding.weight, dim=1))
    vq.requires_grad_(False).eval()
    return records


@torch.no_grad()
def tokenize(vq, x: torch.Tensor) -> torch.Tensor:
    """Codes [n, 81] of images x [n, 3, H, W]: transformers' own JanusVQVAE.encode."""
    return vq.encode(x).image_tokens.view(len(x), -1)


@torch.no_grad()
def reconstruction(vq, vocab: torch.Tensor, n: int, seed: int) -> dict:
    """How much of the world the tokenizer keeps, on n rendered TRAIN images (the originals score strict 1): the
    detector's strict / partial of their reconstructions (encode, then decode), the pixel MSE, the codes in use, and
    the entropy (nats) of a position's code given its 4 x 4 patch (0: one code per patch; what the encoder adds from
    the rest of the image the language model has to predict too)."""
    from rewards.shapes import ShapesReward

    texts, x = Data(random.Random(seed)).batch(n)
    codes = tokenize(vq, x)                                                             # [n, 81]
    rec = vq.decode(codes).clamp(-1, 1)
    r = ShapesReward()(rec, texts)
    patch = torch.cdist(patches(x).flatten(0, 1), vocab).argmin(1)                     # [n * 81]
    return {"strict": round(r["strict"].mean().item(), 4), "partial": round(r["partial"].mean().item(), 4),
            "mse": round(F.mse_loss(rec, x).item(), 5), "codes_used": int(codes.unique().numel()),
            "code_entropy_given_patch": round(conditional_entropy(codes.flatten(), patch), 3)}


def conditional_entropy(y: torch.Tensor, x: torch.Tensor) -> float:
    """H(y | x) in nats of paired samples y [N], x [N] (integer labels): -sum p(x, y) log p(y | x)."""
    joint = torch.zeros(int(x.max()) + 1, int(y.max()) + 1)
    joint.index_put_((x, y), torch.ones(len(x)), accumulate=True)
    p_y = joint / joint.sum(1, keepdim=True).clamp(min=1)                               # p(y | x)
    return -(joint * torch.where(joint > 0, p_y.log(), 0.0)).sum().item() / len(x) + 0.0  # + 0.0: no -0.0


# ------------------------------------------------------------------------------------------------ language model
def lm_loss(policy, vq, texts: list[str], x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the 81 codes of images x [n, 3, H, W] after their prompts; rows where
    drop [n] (bool) is True get the unconditional prompt the policy's CFG sampler builds (JanusPolicy._collate)."""
    from mmrl.policy.janus import positions

    codes = tokenize(vq, x)                                                             # [n, A]
    n = len(texts)
    ids, mask = policy._collate([policy.encode_prompt({"prompt": t}) for t in texts], True)  # [2n, P]: cond, uncond
    ids, mask = torch.where(drop[:, None], ids[n:], ids[:n]), mask[:n]
    image = codes[:, :-1]                                                               # [n, A - 1]
    mask = torch.cat([mask, torch.ones_like(image)], 1)                                 # [n, P + A - 1]
    logits = policy.lm(ids, image, mask, positions(mask), keep=codes.shape[1])[0]      # [n, A, K]
    return F.cross_entropy(logits.flatten(0, 1).float(), codes.flatten())


def train_lm(policy, vq, data: Data, args, clock, rng: random.Random) -> list[dict]:
    """Trains the image-generation path for the rest of args.minutes (or args.lm_steps): AdamW, 50 warm-up steps,
    the lr decaying linearly to 0 over the last args.cooldown of its minutes; returns log records."""
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    policy.lm.train()
    step, records, start = 0, [], clock.minutes()
    budget = args.minutes - start
    losses = []
    while not clock.done(start, budget, step, args.lm_steps):
        texts, x = data.batch(args.batch)
        drop = torch.tensor([rng.random() < args.cond_drop for _ in texts])
        loss = lm_loss(policy, vq, texts, x, drop)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        left = 1 - (clock.minutes() - start) / budget if args.lm_steps == 0 else 1 - step / args.lm_steps
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 50, max(left, 0.0) / args.cooldown)
        opt.step()
        step += 1
        losses.append(loss.item())
        if step % 50 == 0 or step == 1 or clock.done(start, budget, step, args.lm_steps):
            mean = sum(losses) / len(losses)
            print(f"lm step {step} loss {mean:.4f} {clock.minutes():.1f} min", flush=True)
            records.append({"phase": "lm", "step": step, "minutes": round(clock.minutes(), 2), "loss": mean})
            losses = []
    policy.lm.eval()
    return records


# ------------------------------------------------------------------------------------------------ evaluation
def strict_at(policy, split: str, n: int, scale: float, seed: int) -> dict:
    """Strict / partial accuracy of the base on n balanced prompts of a split at CFG `scale` (example i: seed + i)."""
    from mmrl.evaluation import evaluate_outputs
    from rewards.shapes import ShapesReward
    from tasks import shapes

    examples = [{"prompt": p.text, "category": p.spec.category} for p in shapes.balanced_prompts(split, n, seed=1234)]
    policy.eval_cfg_scale = scale
    res = evaluate_outputs(policy.evaluate, examples, ShapesReward(), seed=seed, progress=None)
    return {"strict": res["strict"], "partial": res["partial"],
            "per_category": {c: r["strict"] for c, r in res["per_category"].items()}}


class Clock:
    """Training minutes, paused while evaluating (the evaluations are not in --minutes)."""

    def __init__(self):
        self.t0, self.paused = time.time(), 0.0

    def minutes(self) -> float:
        return (time.time() - self.t0 - self.paused) / 60

    def done(self, start: float, minutes: float, step: int, steps: int) -> bool:
        return step >= steps if steps else self.minutes() - start >= minutes

    @contextlib.contextmanager
    def pause(self):
        t = time.time()
        try:
            yield
        finally:
            self.paused += time.time() - t


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tasks/assets/shapes-ar-base")
    p.add_argument("--minutes", type=float, default=18.0, help="training minutes, VQ and language model together")
    p.add_argument("--vq-minutes", type=float, default=5.0, help="of --minutes, the VQ model's")
    p.add_argument("--vq-steps", type=int, default=0, help="> 0: this many VQ steps instead of --vq-minutes")
    p.add_argument("--lm-steps", type=int, default=0, help="> 0: this many language-model steps instead of the rest")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--vq", default="patches", choices=["patches", "vae"],
                   help="the VQ model's training: patches (a code per 4 x 4 patch of the world) or vae (a VQ-VAE)")
    p.add_argument("--batch", type=int, default=None, help="images per step (default: the size's)")
    p.add_argument("--lr", type=float, default=1e-3, help="language model")
    p.add_argument("--vq-lr", type=float, default=2e-3)
    p.add_argument("--cooldown", type=float, default=0.2, help="fraction of the LM's minutes with the lr decaying to 0")
    p.add_argument("--cond-drop", type=float, default=0.1, help="prompts replaced by the unconditional one (CFG)")
    p.add_argument("--cfg-scales", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0],
                   help="CFG scales scored on TRAIN prompts; the best is pretrain_info.json's cfg_scale")
    p.add_argument("--eval-n", type=int, default=120, help="prompts per evaluation (train and held-out)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="a saved base: train its language model on for --minutes (fresh "
                   "optimizer, VQ model kept), e.g. the equal-time pretraining control of a GRPO run")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 + 3 steps, 6 prompts: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.vq_steps, args.lm_steps, args.eval_n, args.cfg_scales = "tiny", 3, 3, 6, [1.0, 2.0]
    args.batch = args.batch or SIZES[args.size]["batch"]
    if not args.vq_steps and not args.init and not 0 < args.vq_minutes < args.minutes:
        p.error(f"--vq-minutes must be in (0, --minutes={args.minutes}), got {args.vq_minutes}")
    return args


def main(argv=None) -> dict:
    from mmrl.checkpoint import atomic_dir
    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.evaluation import EVAL_SEED
    from mmrl.policy.janus import JanusPolicy, load_janus

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng, wall0 = random.Random(args.seed), time.time()
    vocab, data, clock = patch_vocabulary(), Data(rng), Clock()                         # vocab [85, 48]
    if args.init:  # the pretraining control: the language model of a saved base trained on, its VQ model as saved
        model, processor = load_janus(args.init)
        vq, log = model.model.vqmodel.eval(), []
    else:
        model, processor = build_shapes_janus(SIZES[args.size], len(vocab) if args.vq == "patches" else VAE_CODES,
                                              args.seed)
        vq = model.model.vqmodel
        log = train_vq(vq, data, vocab, args, clock)
    with clock.pause():
        rec = reconstruction(vq, vocab, 24 if args.quick else 480, seed=args.seed + 1)
    log.append({"phase": "vq", "minutes": round(clock.minutes(), 2), "reconstruction": rec})
    print("VQ reconstructions of rendered train images:", rec, flush=True)
    sampler = SamplerConfig(temperature=1.0, cfg_scale=1.0, eval_cfg_scale=1.0)
    policy = JanusPolicy(model=model, processor=processor, sampler_cfg=sampler, lora_cfg=LoraConfig(enabled=False),
                         reference="none", model_path=args.out)
    policy.micro_batch = 64  # rows per sampling forward in the evaluations
    log += train_lm(policy, vq, data, args, clock, rng)
    minutes = clock.minutes()
    with clock.pause():
        train = {s: strict_at(policy, "train", args.eval_n, s, EVAL_SEED) for s in args.cfg_scales}
        best = max(args.cfg_scales, key=lambda s: train[s]["strict"])  # ties: the smaller scale (cheaper sampling)
        heldout = strict_at(policy, "heldout", args.eval_n, best, EVAL_SEED)
    final = {"phase": "eval", "step": log[-1]["step"], "minutes": round(minutes, 2), "cfg_scale": best,
             "train_strict": {str(s): r["strict"] for s, r in train.items()}, "heldout": heldout}
    print(json.dumps(final), flush=True)
    log.append(final)
    with atomic_dir(args.out) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        vq_steps = max((r["step"] for r in log if r["phase"] == "vq" and "step" in r), default=0)
        info = {"command": " ".join(["scripts/pretrain_ar_world.py", *(argv if argv is not None else sys.argv[1:])]),
                "minutes": round(minutes, 2), "wall_minutes": round((time.time() - wall0) / 60, 2),
                "vq_steps": vq_steps, "lm_steps": final["step"], "batch": args.batch, "lr": args.lr,
                "vq_lr": args.vq_lr, "cond_drop": args.cond_drop, "seed": args.seed, "threads": args.threads,
                "size": args.size, "vq": args.vq, "init": args.init,
                "vq_loss": next((r for r in reversed(log) if "recon" in r), None),
                "lm_loss": next(r["loss"] for r in reversed(log) if r["phase"] == "lm"), "reconstruction": rec,
                "cfg_scale": best, "train_strict": final["train_strict"],
                "heldout_strict": heldout["strict"], "eval_n": args.eval_n}
        json.dump(info, open(os.path.join(tmp, "pretrain_info.json"), "w"), indent=2)
    with open(args.out.rstrip("/") + ".log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    print(json.dumps(info), flush=True)
    return info


if __name__ == "__main__":
    main()
