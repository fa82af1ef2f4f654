"""How close one training iteration is to its physical limit on this machine: the iteration's wall time divided by
the time of its model calls alone.

One iteration = `Trainer.step` of the real loop (rollout, reward, advantages, training passes, optimizer steps), run
after a warm-up iteration. During it, hooks on the policy's networks (the flow transformer and its text encoder; the
token policy's language model) and on any reward network record every call: the phase it ran in (the trainer's own
phase timer: rollout, reward, train), its inputs (tensors copied; a KV cache kept as its per-layer shapes), the grad
mode, and which outputs a backward reached. Each call is then replayed standalone, in order, on the same module in
the same train / eval mode: same shapes, same grad mode, forward + backward (random output gradients on the outputs
the iteration backpropagated) where the iteration ran backward. The replay's summed time is the iteration's model
calls; ratio = iteration / model calls (1.0 is the limit); overhead = what is not a model call, per phase (optimizer
steps timed apart inside the training phase). Time spent in the hooks themselves is subtracted from the iteration.

Policies (random init, built here, no hub):
- flow: the shapes world's pixel SD3Transformer2DModel widened to --flow-layers x 12 heads x 64 (6: 123 M
  parameters; 8: 165 M), full fine-tuning, Flow-GRPO with CFG 4.5 (sampler.cfg_grad=cond) in sampling and training, the
  shapes detector as reward (no network);
- token: a causal LM with SmolLM2-135M's body (LlamaForCausalLM, 30 layers x 576, 9 heads, 3 KV heads; a local
  384-token vocabulary: 106 M parameters, 111 M with its adapters) with LoRA rank 16, G completions sharing one
  long prompt (--prompt-tokens), shared-prefix sampling and scoring, a completion-length reward (no network).

    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py            # both at the sizes above (~8 min of CPU time)
    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py --quick    # 2-layer models (~1 min of CPU time)
    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py --policy token --prompt-tokens 2048

Clock: by default the process's CPU time (--clock cpu), so that other work on shared cores, which stretches elapsed
time by a varying factor, does not enter the ratio; with 1 thread it is the time a core computed (waits, which a
1-thread CPU iteration has none of, would go uncounted: use --clock wall on a dedicated machine or an accelerator).
Each timed iteration's calls are replayed --replays times and each call's fastest replay counts. Reported: the
fastest timed iteration over the fastest replay total (each phase's figures likewise: the smallest over the timed
iterations), with the median of the iterations' own ratios beside it.
The last line is one JSON object: per policy, iteration_s, model_s (by phase and by kind: sampling forwards,
training forwards, training backwards, reward forwards), ratio, overhead_s by phase, the calls counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FLOW_BASE = "tasks/assets/shapes-base"
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time  # set by --clock
FILLER = ("The report below describes a small town by the river, its market on the square, the old bridge, "
          "the school, the mill and the people who work there from the early morning until late at night. ")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["flow", "token", "both"], default="both")
    p.add_argument("--quick", action="store_true", help="2-layer models, small rollouts: seconds per iteration")
    p.add_argument("--iterations", type=int, default=2, help="timed iterations (after one warm-up), each replayed")
    p.add_argument("--replays", type=int, default=2, help="standalone replays of each call (its fastest counts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: the process's CPU time (what other work on shared cores does not inflate; with 1 thread "
                        "the compute a core did); wall: elapsed time (a dedicated machine, or an accelerator)")
    p.add_argument("--flow-layers", type=int, default=6, help="SD3 joint blocks of 12 heads x 64 (6: 123 M, 8: 165 M)")
    p.add_argument("--flow-prompts", type=int, default=2)
    p.add_argument("--flow-group", type=int, default=4)
    p.add_argument("--flow-steps", type=int, default=8, help="denoising steps (an SDE window of 3)")
    p.add_argument("--lm-layers", type=int, default=30, help="decoder layers of 576 (SmolLM2-135M: 30)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each shared prompt")
    p.add_argument("--token-prompts", type=int, default=1)
    p.add_argument("--token-group", type=int, default=4)
    p.add_argument("--length", type=int, default=16, help="max completion tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.flow_layers, args.flow_group, args.flow_steps = 2, 2, 2, 4
        args.lm_layers, args.prompt_tokens = 2, 256
    return args


# ------------------------------------------------------------------------------------------------ recording
@dataclass
class Call:
    module: str
    phase: str
    grad: bool
    training: bool
    inputs: tuple                          # (args, kwargs) with tensors copied and caches as CacheSpec
    backward: set = field(default_factory=set)  # indices (in `tensors_of` order) of outputs a backward reached


@dataclass
class TensorCopy:
    value: object  # torch.Tensor, detached
    requires_grad: bool


@dataclass
class CacheSpec:
    cache: object  # the cache object as it came in (its class and settings: layers the model adds are of its kind)
    layers: list   # [(layer object, key shape, value shape, dtype, requires_grad)] as they came in


def is_cache(x) -> bool:
    return hasattr(x, "get_seq_length") and (hasattr(x, "layers") or hasattr(x, "key_cache"))


def cache_tensors(cache) -> list:
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    return [t for kv in zip(cache.key_cache, cache.value_cache) for t in kv]


def tensors_of(obj) -> list:
    """The tensors of a module's output in a fixed order (ModelOutput fields, tuples, KV caches)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if is_cache(obj):
        return cache_tensors(obj)
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def snapshot(obj):
    """A call's inputs as the replay rebuilds them: tensors copied (detached, requires_grad kept), caches as shapes."""
    import torch

    if isinstance(obj, torch.Tensor):
        return TensorCopy(obj.detach().clone(), obj.requires_grad)
    if is_cache(obj):
        if not hasattr(obj, "layers"):  # a legacy cache: its shapes, replayed as a DynamicCache
            ts = cache_tensors(obj)
            return CacheSpec(None, [(None, k.shape, v.shape, k.dtype, k.requires_grad)
                                    for k, v in zip(ts[::2], ts[1::2])])
        return CacheSpec(shell(obj, layers=[]), [(shell(lay), lay.keys.shape, lay.values.shape, lay.keys.dtype,
                                                  lay.keys.requires_grad) if lay.keys is not None else (shell(lay),)
                                                 for lay in obj.layers])
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def shell(obj, **empty):
    """A shallow copy of a cache or cache layer that holds no tensor of the original (they would stay in memory)."""
    import torch

    out = copy.copy(obj)
    for k, v in vars(out).items():
        if isinstance(v, torch.Tensor):
            setattr(out, k, None)
    for k, v in empty.items():
        setattr(out, k, v)
    return out


def rebuild(obj, device):
    """Inputs for a replayed call from `snapshot` (a cache refilled with random keys and values of its shapes)."""
    import torch
    from transformers import DynamicCache

    if isinstance(obj, TensorCopy):
        t = obj.value.clone()
        return t.requires_grad_() if obj.requires_grad and t.is_floating_point() else t
    if isinstance(obj, CacheSpec):
        rand = lambda shape, dtype, rg: torch.randn(shape, dtype=dtype, device=device, requires_grad=rg)  # noqa: E731
        if obj.cache is None:
            cache = DynamicCache()
            for i, (_, ks, vs, dtype, rg) in enumerate(obj.layers):
                cache.update(rand(ks, dtype, rg), rand(vs, dtype, rg), i)
            return cache
        cache, layers = copy.copy(obj.cache), []
        for spec in obj.layers:
            layer = copy.copy(spec[0])  # the same layer class (a KV layer that stores, or one that only reads)
            if len(spec) > 1:
                layer.keys, layer.values = rand(spec[1], spec[3], spec[4]), rand(spec[2], spec[3], spec[4])
            layers.append(layer)
        cache.layers = layers
        return cache
    if isinstance(obj, dict):
        return {k: rebuild(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rebuild(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, device) for v in obj)
    return obj


class PhaseTimer:
    """mmrl.metrics.Timer's interface (`with timer(name)`, `pop()`) that also says which phase is running."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.current = "other"

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.prev, timer.current, self.t0 = timer.current, name, clock()

            def __exit__(self, *exc):
                timer.t[name] = timer.t.get(name, 0.0) + clock() - self.t0
                timer.current = self.prev

        return _Ctx()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.t.items()}
        self.t = {}
        return out


class Recorder:
    """Forward pre / post hooks on named modules that record each call (`Call`) while `on`."""

    def __init__(self, modules: dict, phase):
        self.modules, self.phase, self.on, self.calls, self.hook_s, self.stack = modules, phase, False, [], 0.0, []
        for name, m in modules.items():
            m.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True)
            m.register_forward_hook(partial(self._post, name), with_kwargs=True)

    def _pre(self, name, module, args, kwargs):
        if self.on:
            import torch

            t0 = clock()
            self.stack.append(Call(name, self.phase(), torch.is_grad_enabled(), module.training,
                                   (snapshot(args), snapshot(kwargs))))
            self.hook_s += clock() - t0

    def _post(self, name, module, args, kwargs, output):
        if self.on:
            t0 = clock()
            call = self.stack.pop()
            if call.grad:
                for i, t in enumerate(tensors_of(output)):
                    if t.requires_grad:
                        t.register_hook(partial(self._reached, call, i))
            self.calls.append(call)
            self.hook_s += clock() - t0

    def _reached(self, call, i, grad):
        call.backward.add(i)


def replay(calls: list[Call], modules: dict, params: list) -> list[tuple[float, float]]:
    """(forward s, backward s) of each call run standalone."""
    import torch

    out = []
    for c in calls:
        m = modules[c.module]
        device = next(m.parameters()).device
        args, kwargs = rebuild(c.inputs, device)
        was = m.training
        m.train(c.training)
        with torch.set_grad_enabled(c.grad):
            t0 = clock()
            res = m(*args, **kwargs)
            fwd = clock() - t0
            bwd = 0.0
            if c.backward:
                ts = tensors_of(res)
                outs = [ts[i] for i in sorted(c.backward)]
                grads = [torch.randn_like(t) for t in outs]
                t0 = clock()
                torch.autograd.backward(outs, grads)
                bwd = clock() - t0
        m.train(was)
        del res, args, kwargs
        for p in params:
            p.grad = None
        out.append((fwd, bwd))
    return out


# ------------------------------------------------------------------------------------------------ the policies
def flow_folder(path: str, layers: int) -> None:
    """The shapes base with its transformer widened (random init, fp32), as bench_memory_dist.py builds it."""
    import torch
    from diffusers import SD3Transformer2DModel

    shutil.copytree(FLOW_BASE, path, ignore=shutil.ignore_patterns("transformer"))
    config = {k: v for k, v in json.load(open(os.path.join(FLOW_BASE, "transformer", "config.json"))).items()
              if not k.startswith("_")}
    config.update(num_layers=layers, num_attention_heads=12, attention_head_dim=64, caption_projection_dim=768)
    torch.manual_seed(0)
    SD3Transformer2DModel(**config).save_pretrained(os.path.join(path, "transformer"))


def flow_overrides(folder: str, args, out: str) -> tuple[str, list[str]]:
    window = min(3, args.flow_steps - 1)
    return "configs/t2i/shapes_grpo.yaml", [
        f"model.path={folder}", "sampler.cfg_scale=4.5", "sampler.cfg_grad=cond",
        f"sampler.num_steps={args.flow_steps}",
        f"sampler.sde_window_size={window}", f"sampler.sde_window_range=[0,{args.flow_steps - window}]",
        f"train.prompts_per_iter={args.flow_prompts}", f"train.group_size={args.flow_group}", "train.minibatches=2",
        "model.reference=none", "algo.kl_coef=0.0"] + common(out, args)


def token_folder(path: str, layers: int) -> None:
    """A LlamaForCausalLM with SmolLM2-135M's layers (`layers` of them) and a local tokenizer with a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmrl.models.qwen_vl import build_tokenizer

    tok = build_tokenizer([FILLER, "user assistant"])
    hidden, heads, kv, inter = 576, 9, 3, 1536
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                 max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                                 bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)


def register_token_task(folder: str, n_tokens: int) -> None:
    """Task `bench_limit_long`: distinct prompts of n_tokens tokens each; reward `bench_limit_length`: shorter is
    better (no network)."""
    import torch
    from transformers import AutoTokenizer

    from mmrl.reward import REWARDS
    from mmrl.task import TASKS

    if "bench_limit_long" in TASKS:
        return
    tok = AutoTokenizer.from_pretrained(folder)
    base = tok(FILLER * (n_tokens // 20 + 8), add_special_tokens=False).input_ids

    def prompt(i: int) -> str:
        return f"Question {i}: " + tok.decode(base[:n_tokens - 8])

    class LongPrompts:
        def __init__(self, cfg):
            self.examples = [{"prompt": prompt(i)} for i in range(64)]

        def sample(self, n, rng):
            return [self.examples[rng.randrange(len(self.examples))] for _ in range(n)]

        def eval_examples(self):
            return self.examples[:1]

    TASKS.register("bench_limit_long")(LongPrompts)
    REWARDS.register("bench_limit_length")(
        lambda **_: lambda outputs, examples: {"overall": torch.tensor([-len(o) / 100.0 for o in outputs])})


def token_overrides(folder: str, args, out: str) -> tuple[None, list[str]]:
    return None, [
        "model.policy=token", f"model.path={folder}", "model.reference=none", "model.lora.enabled=true",
        "model.lora.rank=16", "model.lora.alpha=32", "sampler.temperature=1.0", f"sampler.max_new_tokens={args.length}",
        "task.name=bench_limit_long", "reward.name=bench_limit_length", "algo.clip_range=0.2",
        "algo.loss_agg=seq_mean_token_mean", f"train.prompts_per_iter={args.token_prompts}",
        f"train.group_size={args.token_group}", "train.minibatches=2", "train.lr=2e-4"] + common(out, args)


def common(out: str, args) -> list[str]:
    return [f"train.threads={args.threads}", "train.iterations=100", f"log.out_dir={out}", "log.tensorboard=false",
            "log.progress=false", "log.image_every=0", "log.save_every=100000", "log.eval_at_start=false"]


def networks(trainer, kind: str) -> dict:
    """The networks whose calls count as model calls: the policy's trained networks and text encoders, and any
    torch module the reward holds."""
    import torch

    pol = trainer.policy
    if kind == "flow":
        mods = {"transformer": pol.model.transformer}
        if pol.model.transformer_2 is not None:
            mods["transformer_2"] = pol.model.transformer_2
        mods.update({f"text_encoder_{i}": m for i, m in enumerate(pol.model.text_modules)})
    else:
        mods = {"lm": pol.model}
    seen = {id(m) for m in mods.values()}
    for name, v in vars(trainer.reward_fn).items() if hasattr(trainer.reward_fn, "__dict__") else ():
        if isinstance(v, torch.nn.Module) and id(v) not in seen:
            mods[f"reward.{name}"] = v
    return mods


# ------------------------------------------------------------------------------------------------ measuring
def measure(kind: str, args, tmp: str) -> dict:
    import torch

    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    folder = os.path.join(tmp, kind)
    if kind == "flow":
        flow_folder(folder, args.flow_layers)
        config, overrides = flow_overrides(folder, args, os.path.join(tmp, "run-flow"))
    else:
        token_folder(folder, args.lm_layers)
        register_token_task(folder, args.prompt_tokens)
        config, overrides = token_overrides(folder, args, os.path.join(tmp, "run-token"))
    trainer = Trainer(load_config(config, overrides))
    timer = PhaseTimer()
    trainer.timer = trainer.collect.timer = timer
    opt_s = [0.0]
    step = trainer.opt.step

    def timed_step(*a, **k):  # the optimizer step: no model call, timed apart
        t0 = clock()
        r = step(*a, **k)
        opt_s[0] += clock() - t0
        return r

    trainer.opt.step = timed_step
    mods = networks(trainer, kind)
    rec = Recorder(mods, lambda: timer.current)
    params = [p for m in mods.values() for p in m.parameters()]
    trainer.step(0)  # warm-up
    runs = []
    for it in range(1, args.iterations + 1):
        rec.calls, rec.hook_s, opt_s[0], rec.on = [], 0.0, 0.0, True
        t0 = clock()
        metrics = trainer.step(it)
        wall = clock() - t0 - rec.hook_s
        rec.on = False
        phases = {k[5:]: v for k, v in metrics.items() if k.startswith("time/")}
        rounds = [replay(rec.calls, mods, params) for _ in range(args.replays)]
        times = [min(r, key=sum) for r in zip(*rounds)]  # each call's fastest replay
        runs.append(summarize(rec.calls, times, wall, phases, opt_s[0], rec.hook_s))
    trainer.logger.close()
    trainer.collect.close()
    lo = lambda key: {p: min(r[key].get(p, 0.0) for r in runs) for p in runs[0][key]}  # noqa: E731
    it_s, model_s = min(r["iteration_s"] for r in runs), min(r["model_s"] for r in runs)
    walls, model_phase = lo("phase_wall_s"), lo("model_by_phase_s")
    over = {p: walls[p] - model_phase.get(p, 0.0) for p in walls}
    if "train" in over:
        opt = min(r["overhead_s"]["train_optimizer_step"] for r in runs)
        over.update(train=over["train"] - opt, train_optimizer_step=opt)
    n_params = sum(p.numel() for p in mods[next(iter(mods))].parameters())
    rnd = lambda d: {k: round(v, 3) for k, v in d.items()}  # noqa: E731
    return {"params_m": round(n_params / 1e6, 1), "iteration_s": round(it_s, 3), "model_s": round(model_s, 3),
            "ratio": round(it_s / model_s, 3), "ratio_median": round(statistics.median(r["ratio"] for r in runs), 3),
            "model_by_phase_s": rnd(model_phase), "model_by_kind_s": rnd(lo("model_by_kind_s")),
            "overhead_s": rnd(over), "phase_wall_s": rnd(walls), "hook_s": round(max(r["hook_s"] for r in runs), 4),
            "calls": runs[-1]["calls"],
            "iterations": [{k: round(r[k], 3) for k in ("iteration_s", "model_s", "ratio")} for r in runs]}


def summarize(calls, times, wall, phases, opt_s, hook_s) -> dict:
    by_phase, by_kind, counts = {}, {}, {}
    for c, (f, b) in zip(calls, times):
        by_phase[c.phase] = by_phase.get(c.phase, 0.0) + f + b
        kind = ("reward" if c.phase == "reward" or c.module.startswith("reward.") else
                "train" if c.phase == "train" else "sampling")
        fk = f"{kind}_forward" + ("" if c.grad or kind != "train" else "_no_grad")
        by_kind[fk] = by_kind.get(fk, 0.0) + f
        if b:
            by_kind[f"{kind}_backward"] = by_kind.get(f"{kind}_backward", 0.0) + b
        key = f"{c.module}/{c.phase}/{'grad' if c.grad else 'no_grad'}{'+backward' if c.backward else ''}"
        counts[key] = counts.get(key, 0) + 1
    model = sum(by_phase.values())
    phases = {p: phases.get(p, 0.0) for p in ("rollout", "reward", "train") if p in phases or p in by_phase}
    phases["other"] = wall - sum(phases.values())
    overhead = {p: phases[p] - by_phase.get(p, 0.0) for p in phases}
    if "train" in overhead:  # the optimizer steps apart from the rest of the training phase
        overhead["train"] -= opt_s
        overhead["train_optimizer_step"] = opt_s
    return {"iteration_s": wall, "model_s": model, "ratio": wall / model, "hook_s": hook_s,
            "model_by_phase_s": by_phase, "model_by_kind_s": by_kind, "overhead_s": overhead, "phase_wall_s": phases,
            "calls": counts}


def main(argv=None):
    global clock
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    import torch

    torch.set_num_threads(args.threads)
    kinds = ["flow", "token"] if args.policy == "both" else [args.policy]
    out = {"threads": args.threads, "clock": args.clock, "quick": args.quick, "iterations": args.iterations}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            r = measure(kind, args, tmp)
            out[kind] = r
            over = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["overhead_s"].items(), key=lambda kv: -kv[1]))
            print(f"{kind} ({r['params_m']} M): iteration {r['iteration_s']:.2f} s, model calls {r['model_s']:.2f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in r['model_by_kind_s'].items())}), ratio {r['ratio']:.3f}; "
                  f"overhead s: {over}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
