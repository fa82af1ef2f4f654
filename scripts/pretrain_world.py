"""Pretrain an embedded world's base model by flow matching on rendered images or clips (CPU is fine; GPU if
present). Reproduces the committed base checkpoints (see README for their exact histories):

    python scripts/pretrain_world.py --world shapes --minutes 90 --out tasks/assets/shapes-base
    python scripts/pretrain_world.py --world motion --coordinates --init OLD_MOTION_BASE --minutes 40 --batch 32 \
        --lr 3e-4 --logit-mean 1.5 --threads 1 --out BASE30      # stopped at its 30-min save
    python scripts/pretrain_world.py --world motion --coordinates --init BASE30 --minutes 8 --cooldown 0 \
        --batch 32 --lr 3e-4 --logit-mean 1.5 --threads 1 --out tasks/assets/motion-base

Trains the pixel-space transformer (SD3Transformer2DModel for shapes, WanTransformer3DModel for motion) and its
CLIP text encoder jointly from scratch on the world's TRAIN texts (held-out texts are never seen; categories or
directions sampled equally), 10% of prompts dropped to "" for classifier-free guidance, logit-normal sigmas
(SD3; `--logit-mean` > 0 trains more on high noise, where a clip's layout and motion are decided), the loss on
the velocity whatever the transformer predicts (`--prediction sample` is JiT-style x-prediction), EMA weights
saved. The learning rate warms up, stays constant, and cools down linearly to 0 over the last `--cooldown`
fraction of `--minutes`. Every --eval-every minutes the EMA model is scored on held-out prompts (ODE sampling)
and the folder is rewritten atomically; Ctrl-C stops and keeps the last save. `--resume` continues from the
training state beside the output folder; `--init` starts from a saved model's weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import time

import torch


from mmrl.checkpoint import atomic_dir
from mmrl.models.families.pixel import wan_call, wan_coord_call
from mmrl.models.flow_model import sd3_call
from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
from mmrl.models.flow_model import FlowModel, velocity_from_prediction
from mmrl.models.families.pixel import make_clip_encoder


class World:
    """What pretraining needs from an embedded world: its texts, training batches and the held-out benchmark."""

    def __init__(self, name: str, size: int):
        from tasks import motion, shapes

        self.name, self.size = name, size
        self.mod = shapes if name == "shapes" else motion
        self.frames = 0 if name == "shapes" else motion.FRAMES
        train = self.mod.prompts("train")
        groups = {}
        for p in train:  # shapes: categories drawn equally; motion: directions
            groups.setdefault(getattr(p.spec, "category", getattr(p.spec, "direction", "")), []).append(p)
        self.groups = [groups[k] for k in sorted(groups)]

    def batch(self, n: int, rng: random.Random):
        ps = [rng.choice(rng.choice(self.groups)) for _ in range(n)]
        if self.frames:
            x0 = torch.stack([self.mod.render(p.spec, self.frames, self.size, rng) for p in ps])
        else:
            x0 = torch.stack([self.mod.to_tensor(self.mod.render(p.spec, self.size, rng)) for p in ps])
        return [p.text for p in ps], x0

    def evaluate(self, model: FlowModel, n: int, seed: int = 0) -> dict:
        from rewards import motion as motion_reward, shapes as shapes_reward

        evaluate = (motion_reward if self.frames else shapes_reward).evaluate
        return evaluate(model, self.mod.balanced_prompts("heldout", n, seed=1234), seed=seed, progress=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="shapes", choices=["shapes", "motion"])
    p.add_argument("--out", default="tasks/assets/shapes-base")
    p.add_argument("--minutes", type=float, default=90.0, help="wall-clock training budget")
    p.add_argument("--size", default="small", choices=["small", "tiny"])
    p.add_argument("--image-size", type=int, default=None, help="frame size (default: shapes 36, motion 16)")
    p.add_argument("--patch", type=int, default=4, help="transformer patch size (pixels per token side)")
    p.add_argument("--coordinates", action="store_true",
                   help="video model: 3 coordinate input channels (absolute frame, row, column; see wan_coord_call)")
    p.add_argument("--prediction", default="velocity", choices=["velocity", "sample"],
                   help="what the transformer outputs (the loss is on the velocity either way)")
    p.add_argument("--cooldown", type=float, default=0.2, help="fraction of --minutes with the lr decaying to 0")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--logit-mean", type=float, default=0.0,
                   help="location of the logit-normal sigma distribution (SD3: 0; > 0 trains more on high noise, "
                   "where a clip's layout and motion are decided)")
    p.add_argument("--logit-std", type=float, default=1.0, help="scale of the logit-normal sigma distribution")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=10.0, help="minutes between evals/saves")
    p.add_argument("--eval-n", type=int, default=120)
    p.add_argument("--eval-seed", type=int, default=0,
                   help="noise seed of the held-out evaluation (prompt i uses seed + i); 10000 is mmrl's trainer "
                   "evaluation of the same prompts (task.eval_prompts)")
    p.add_argument("--keep-saves", action="store_true",
                   help="keep a copy of every save as OUT.stepNNNNNN, and save at whole multiples of --eval-every "
                   "from the start (as mmrl's log.eval_every_min), so that runs compared at equal wall time are saved "
                   "at the same minutes (compare_flow_rl.py's control arm)")
    p.add_argument("--resume", action="store_true", help="continue from OUT.train_state.pt (weights, EMA, optimizer)")
    p.add_argument("--init", default=None, help="start from the weights of a saved model folder (fresh optimizer), "
                   "e.g. to continue pretraining the committed base as a control")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = World(args.world, args.image_size or (36 if args.world == "shapes" else 16))
    words = sorted({w for p in world.mod.all_prompts() for w in p.text.split()})
    parts = build_pipeline_parts(words, args.size, world.size, patch_size=args.patch, frames=world.frames,
                                 coordinates=args.coordinates)
    call = (wan_coord_call if args.coordinates else wan_call) if world.frames else sd3_call
    if args.init:
        init_from(parts, args.init)
    te, tr = parts["text_encoder"].to(device), parts["transformer"].to(device)
    params = list(tr.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    ema_tr, ema_te = copy.deepcopy(tr).requires_grad_(False), copy.deepcopy(te).requires_grad_(False)
    ema_params = list(ema_tr.parameters()) + list(ema_te.parameters())
    state_path = args.out.rstrip("/") + ".train_state.pt"
    step, elapsed = 0, 0.0
    if args.resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=True)
        for p, v in zip(params, st["params"]):
            p.data.copy_(v)
        for p, v in zip(ema_params, st["ema"]):
            p.data.copy_(v)
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        rng.setstate((st["rng"][0], tuple(st["rng"][1]), st["rng"][2]))
        print(f"resumed at step {step}, {elapsed / 60:.1f} min")
    encode = make_clip_encoder(parts["tokenizer"], te)
    t0, last_eval = time.time() - elapsed, time.time()
    n_saves = int(elapsed // (args.eval_every * 60))  # --keep-saves: timed saves so far (a resumed run keeps its clock)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    log = open(args.out.rstrip("/") + ".log.jsonl", "a")
    try:
        while True:
            texts, x0 = world.batch(args.batch, rng)
            x0 = x0.to(device)
            texts = ["" if rng.random() < args.cond_drop else t for t in texts]
            enc, pooled = encode(texts)
            z = args.logit_mean + args.logit_std * torch.randn(args.batch, device=device)
            sigma = torch.sigmoid(z)  # logit-normal (SD3)
            eps = torch.randn_like(x0)
            s4 = sigma.view(-1, *[1] * (x0.dim() - 1))
            xt = (1 - s4) * x0 + s4 * eps
            out = call(tr, xt, sigma, enc, pooled)
            loss = torch.nn.functional.mse_loss(velocity_from_prediction(out, xt, sigma, args.prediction), eps - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            left = 1 - (time.time() - t0) / (args.minutes * 60)  # fraction of the budget left
            lr_scale = min(1.0, (step + 1) / 500, max(left, 0.0) / args.cooldown if args.cooldown > 0 else 1.0)
            for g in opt.param_groups:
                g["lr"] = args.lr * lr_scale
            opt.step()
            step += 1
            decay = min(args.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(ema_params, params, 1 - decay)
            done = time.time() - t0 >= args.minutes * 60
            if step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min", flush=True)
            if args.keep_saves:
                due = time.time() - t0 >= args.eval_every * 60 * (1 + n_saves)
                n_saves += due
            else:
                due = time.time() - last_eval >= args.eval_every * 60
            if done or due:
                save(args, parts, ema_tr, ema_te, params, ema_params, opt, step, time.time() - t0, rng, state_path)
                if args.keep_saves:
                    shutil.copytree(args.out, f"{args.out.rstrip('/')}.step{step:06d}", dirs_exist_ok=True)
                shape = (3, world.frames, world.size, world.size) if world.frames else (3, world.size, world.size)
                model = FlowModel(ema_tr, make_clip_encoder(parts["tokenizer"], ema_te), lambda x: x.clamp(-1, 1),
                                  shape, (ema_te,), prediction=args.prediction, call=call)
                res = world.evaluate(model, args.eval_n, args.eval_seed)
                rec = {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": loss.item(), **res}
                print(json.dumps(rec), flush=True)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                last_eval = time.time()
            if done:
                break
    except KeyboardInterrupt:
        print("interrupted; last save kept")


def init_from(parts: dict, path: str) -> None:
    """Start from the model folder `path`: its tokenizer and text encoder as saved (token ids and pooling
    unchanged), its transformer weights copied in. An input projection that this model widens (`--coordinates`
    on a base without them) keeps the old channels' weights and starts the new ones at zero, so the widened model
    computes exactly what the base computed until training moves them."""
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

    from mmrl.models.pipelines import load_flow_model

    parts["tokenizer"] = PreTrainedTokenizerFast.from_pretrained(os.path.join(path, "tokenizer"))
    parts["text_encoder"] = CLIPTextModelWithProjection.from_pretrained(os.path.join(path, "text_encoder"))
    src, dst = load_flow_model(path).transformer.state_dict(), parts["transformer"].state_dict()
    for k, v in src.items():
        if k not in dst:
            raise ValueError(f"--init {path}: parameter {k} does not exist in the model being trained")
        if v.shape != dst[k].shape:
            if v.dim() < 2 or v.shape[0] != dst[k].shape[0] or v.shape[2:] != dst[k].shape[2:]:
                raise ValueError(f"--init {path}: {k} has shape {tuple(v.shape)}, this model {tuple(dst[k].shape)}")
            v = torch.cat([v, v.new_zeros(v.shape[0], dst[k].shape[1] - v.shape[1], *v.shape[2:])], 1)
        dst[k] = v
    parts["transformer"].load_state_dict(dst)
    print(f"initialized from {path}")


def save(args, parts, ema_tr, ema_te, params, ema_params, opt, step, elapsed, rng, state_path):
    with atomic_dir(args.out) as tmp:
        save_pipeline_parts({**parts, "transformer": ema_tr, "text_encoder": ema_te}, tmp, args.prediction)
        with open(os.path.join(tmp, "pretrain_info.json"), "w") as f:
            json.dump({"step": step, "minutes": round(elapsed / 60, 2), "batch": args.batch, "lr": args.lr,
                       "ema": args.ema, "seed": args.seed, "prediction": args.prediction,
                       "logit_mean": args.logit_mean, "logit_std": args.logit_std,
                       "coordinates": args.coordinates,
                       "command": " ".join(sys.argv)}, f, indent=2)
    st = {"params": [p.detach().cpu() for p in params], "ema": [p.detach().cpu() for p in ema_params],
          "opt": opt.state_dict(), "step": step, "elapsed": elapsed, "rng": list(rng.getstate())}
    torch.save(st, state_path + ".tmp")
    os.replace(state_path + ".tmp", state_path)


if __name__ == "__main__":
    main()
