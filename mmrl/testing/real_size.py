"""`python scripts/gpu_check.py --real-size`: four GPU recipes at the real size of their models, on one GPU, without
the hub: per phase (start-up, sampling, decode, training, save, resume) the peak memory beside `mmrl plan`'s figure
for the same run, the seconds it took, the seconds per iteration, the optimizer steps skipped for a non-finite
gradient, and the model-FLOPs utilization (MFU) of sampling and of training.

    python scripts/gpu_check.py --real-size                      # on CUDA, real size (~10 min on one H200)
    python scripts/gpu_check.py --real-size --device cpu         # the CPU dry run: the same code at reduced size
    python scripts/gpu_check.py --real-size --only flux          # the recipes whose name contains a word

Recipes (RECIPES): FLUX.1-dev LoRA (`t2i/flux_lora`, its 11.9 B transformer), SD3.5-Medium LoRA on GenEval
(`t2i/sd35_geneval_lora`, 2.24 B), Wan2.1-T2V-1.3B LoRA (`t2v/wan_lora`, 1.4 B), Qwen2.5-VL-7B grounding
(`grounding/charades_qwen25vl_lora`, 8.29 B with its vision tower, on 30 s 640 x 480 videos read at the recipe's fps
and pixel limits; with LoRA, the override the recipe names: its full fine-tuning keeps 8.3 B fp32 weights,
gradients and AdamW state, ~133 GB, which no single GPU holds).

How the models are built (no weights, no hub, nothing large written to disk). The trained model is the published
architecture (its family's `architectures` entry, mmrl/models/architectures.py for Qwen2.5-VL) at real size; a flow
model's text encoders keep their real classes, widths and vocabularies (CLIP-L, CLIP-G, T5-XXL, umT5-XXL) with
TEXT_LAYERS layers each, and its VAE is the released one's architecture; tokenizers are small local BPE ones (the
prompts are still padded to the real lengths: 77 CLIP tokens, 512 / 128 T5 tokens). Each module is built with its
parameters on the meta device (accelerate's `init_empty_weights`, real buffers), cast to the dtypes
`from_pretrained(dtype=bf16)` gives (mmrl.models.shard_load.to_load_dtype), given storage on the GPU
(`materialize`) and initialized there (each module's `reset_parameters`, norms 1, biases 0, other tensors
N(0, 0.02)): seconds, and the device never holds more than the bf16 model, as a real load. The models reach the
trainer through its own code: a stub model folder holds model_index.json and each component's config.json (what
`load_flow_model` checks and what `mmrl plan` reads), and the family's `from_pretrained` (token policy:
`load_token_model`) is patched to return the pipeline built on the device, so the family's `load`, the policy,
LoRA, the trainer's loop, its checkpoint and `--resume` all run unchanged (the resumed trainer builds its model
the same way, then loads the checkpoint).

What is not the recipe: the reward is a stand-in (StandInReward: an image's or clip's mean value, a text's hash;
it varies within groups, so advantages are non-zero); evaluation is skipped (the check is memory and throughput);
one group of prompts per iteration (train.prompts_per_iter=1) and, for the flow recipes, a trained window of 2
denoising steps (sampler.sde_window_size; every step is still sampled) so that 2 iterations of the four fit ~10
minutes; one process (train.parallel=none); resolution, frames, steps, group size, micro-batch, new tokens, LoRA,
CFG, KL and EMA are the recipe's. Three non-finite
steps in a row do not stop the run here (they are counted: random weights in bf16 may overflow). `mmrl plan`'s
figures are of the same configuration (the stub folder's configs, world 1, measured on fake tensors) and run in
worker processes beside the GPU work (a real-size measured plan takes minutes of CPU); its resume figure is its
start-up plus the AdamW state and EMA a checkpoint restores (by hand).

Measured: peak memory per phase is torch.cuda.max_memory_allocated, reset at each phase's start (phases that
alternate, sampling and its VAE decode chunks, keep their largest segment); on CPU the process's resident peak
(VmHWM, reset through /proc/self/clear_refs) minus its size before the recipe's start-up. Seconds are the phase's
wall time in the second (timed) iteration; sampling excludes its decode. Seconds per iteration: the trainer's own
perf/iteration_s (metrics.jsonl). MFU = `mmrl plan`'s transformer FLOPs of the phase per iteration (sampling:
no-grad forwards of every chain step; training: forward + backward, + one recomputing forward under gradient
checkpointing) / (seconds x the GPU's dense bf16 peak: PEAK_FLOPS by device name). On CPU the peak is a nominal
NOMINAL_CPU_FLOPS per thread (printed as such): its MFU only shows the column. The plan counts every row's whole
sequence, while the token policy prefills a group's shared prompt once (PrefixCacheEngine) and may score it once
(model.shared_prefix): with a long video prompt its MFU is of model FLOPs as if rows were independent, an upper
bound up to G times the work done (a CPU check at real widths, 1 LM layer, 4,095 prompt tokens: 220 % "MFU").

The CPU dry run (`--device cpu`, scale "reduced") builds the same recipes through the same code with the configs of
each family's tiny pipeline (and a tiny Qwen2.5-VL), small resolution, frames and groups: a few minutes on 2 cores.
The last stdout line is one JSON object: {"ok", "device", "scale", "recipes": {recipe: {"phases": {phase:
{"peak_mib", "plan_mib", "seconds"}}, "iteration_s", "nonfinite_steps", "mfu_sampling", "mfu_training", ...}}}.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import multiprocessing
import os
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT_LAYERS = 2          # layers of each flow model's text encoders (their widths and vocabularies are the real ones)
PHASES = ("startup", "sampling", "decode", "training", "save", "resume")
PLAN_KEYS = {"startup": "startup_gib", "sampling": "sampling_gib", "decode": "decode_gib", "training": "train_gib",
             "save": "save_gib"}
# dense bf16 peak FLOP/s by device name (no sparsity)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12}
PROMPTS = ("a cat on a sofa", "a red car at night", "two dogs in the snow", "a lighthouse on a cliff at dawn")
NOMINAL_CPU_FLOPS = 50e9  # per thread: a nominal figure, not a measured one
# the CPU dry run: tiny sizes everywhere (as scripts/gpu_check.py's tiny recipes)
_SMALL = ("train.prompts_per_iter=1", "train.group_size=4", "train.minibatches=2", "train.grad_accum=1",
          "model.lora.rank=4", "model.lora.alpha=8")
_SMALL_FLOW = (*_SMALL, "model.sample_size=8", "sampler.num_steps=4", "sampler.sde_window_size=2",
               "model.text_max_length=16")


@dataclass(frozen=True)
class Recipe:
    arch: str                     # its published architecture (mmrl plan --arch; a family's or ARCHITECTURES')
    real: tuple[str, ...]         # overrides at real size (beyond the common ones of `overrides`)
    reduced: tuple[str, ...]      # overrides of the CPU dry run
    vae: tuple = ()               # the released VAE's latent scaling (not in the families' shared VAE config)


RECIPES = {  # the token recipe first: its plan (which needs its prompt length) then runs beside the flow recipes
    "grounding/charades_qwen25vl_lora": Recipe(
        "qwen25-vl-7b", ("train.prompts_per_iter=1", "model.lora.enabled=true", "train.lr=1e-5"),
        (*_SMALL, "model.lora.enabled=true", "sampler.max_new_tokens=8", "video.min_pixels=3136",
         "video.max_pixels=3136", "video.total_pixels=null")),
    "t2i/sd35_geneval_lora": Recipe(
        "sd35-medium", ("train.prompts_per_iter=1", "sampler.sde_window_size=2"),
        _SMALL_FLOW,
        (("scaling_factor", 1.5305), ("shift_factor", 0.0609))),
    "t2v/wan_lora": Recipe(
        "wan21-1.3b", ("train.prompts_per_iter=1", "sampler.sde_window_size=2"),
        (*_SMALL_FLOW, "model.sample_size=4", "model.num_frames=5")),
    "t2i/flux_lora": Recipe(
        "flux1-dev", ("train.prompts_per_iter=1", "sampler.sde_window_size=2"),
        _SMALL_FLOW, (("scaling_factor", 0.3611), ("shift_factor", 0.1159))),
}


# ------------------------------------------------------------------------------------------------ the stand-in reward
class StandInReward:
    """A reward that costs nothing and varies within a group: an image's / clip's mean value (outputs [N, 3, ...] in
    [-1, 1]), a text's CRC32 hash in [0, 1)."""

    def __call__(self, outputs, examples):
        if isinstance(outputs, torch.Tensor):
            score = outputs.float().flatten(1).mean(1).nan_to_num(0.0)
        else:
            score = torch.tensor([zlib.crc32(str(o).encode()) / 2**32 for o in outputs])
        return {"overall": score.cpu()}


# --------------------------------------------------------------------------------------------- building the models
@torch.no_grad()
def init_random(module: torch.nn.Module) -> None:
    """Random weights in place: each module's own `reset_parameters` (linear, conv, embedding, norm layers), then the
    rest: 1-D biases 0, other 1-D tensors (norm scales) 1, the others N(0, 0.02)."""
    done = set()
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and any(True for _ in m.parameters(recurse=False)):
            try:
                reset()
            except Exception:  # noqa: BLE001 - a custom reset that needs more than its parameters: the fallback
                continue
            done.update(id(p) for p in m.parameters(recurse=False))
    for name, p in module.named_parameters():
        if id(p) in done:
            continue
        if p.dim() <= 1:
            p.fill_(0.0 if name.rsplit(".", 1)[-1].startswith("bias") else 1.0)
        else:
            p.normal_(0.0, 0.02)


def build_module(cls, config, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """`cls` (a diffusers or transformers model class) of `config` with random weights on `device` in the dtypes
    `from_pretrained(dtype=dtype)` gives, built without a CPU copy: parameters on meta, then storage on the device,
    then init there. device "meta": the skeleton only."""
    import transformers
    from accelerate import init_empty_weights

    from mmrl.models.shard_load import materialize, to_load_dtype

    with init_empty_weights(include_buffers=False):
        model = cls(config) if issubclass(cls, transformers.PreTrainedModel) else cls.from_config(config)
    to_load_dtype(model, dtype)
    if device != "meta":
        materialize(model, torch.device(device))
        init_random(model)
    return model.eval()


def _text_config(cls_name: str, conf_name: str, conf: dict, tok):
    """A frozen text encoder's config at its real width, TEXT_LAYERS layers, special ids of the local tokenizer."""
    import transformers

    conf = dict(conf)
    conf["num_layers" if "T5" in conf_name else "num_hidden_layers"] = TEXT_LAYERS
    conf.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if "CLIP" in conf_name:
        conf["bos_token_id"] = tok.bos_token_id
    return getattr(transformers, conf_name)(**conf)


def build_pipeline(recipe: Recipe, scale: str, dtype: torch.dtype, device: str):
    """The diffusers pipeline of a flow recipe's family, its modules built by `build_module` ("real": the published
    transformer, the real text encoders' widths with TEXT_LAYERS layers, the released VAE; "reduced": the configs of
    the family's tiny pipeline); scheduler and tokenizers from the tiny pipeline (T5 tokenizers padded to 512)."""
    import diffusers
    import transformers

    from mmrl.models.families import all_architectures

    arch = all_architectures()[recipe.arch]
    family = arch["family"]
    tiny = family.tiny(0)
    parts = dict(tiny.components)
    encoders, (vae_cls, vae_conf) = arch.get("frozen_parts") or family.frozen_parts
    names = sorted(n for n, m in parts.items() if n.startswith("text_encoder") and m is not None)
    for name, module in list(parts.items()):
        if not isinstance(module, torch.nn.Module):
            continue
        if scale == "reduced":
            config = module.config
        elif name == "transformer":
            config = arch["config"]
        elif name == "vae":
            config = {**vae_conf, **dict(recipe.vae)}
        else:
            cls_name, conf_name, conf = encoders[names.index(name)]
            if cls_name != type(module).__name__:
                raise RuntimeError(f"{family.name}: {name} is a {type(module).__name__}, its published part a "
                                   f"{cls_name}")
            tok = parts["tokenizer" + name[len("text_encoder"):]]
            config = _text_config(cls_name, conf_name, conf, tok)
            if "T5" in conf_name:
                tok.model_max_length = 512
        cls = getattr(transformers if isinstance(module, transformers.PreTrainedModel) else diffusers,
                      type(module).__name__)
        parts[name] = build_module(cls, config, dtype, device)
    return type(tiny)(**parts)


def build_token_model(recipe: Recipe, scale: str, dtype: torch.dtype, device: str, frame_pixels: int):
    """(Qwen2.5-VL model, processor): the published 7B architecture ("real") or the tiny one ("reduced"), random
    weights on the device, a local tokenizer whose special tokens the config names; frames resized to
    `frame_pixels` (video.max_pixels)."""
    import transformers

    from mmrl.models.architectures import ARCHITECTURES
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer

    tok = build_tokenizer(["When does this happen? the person opens the door. Answer in seconds. <answer>0 to 1"])
    if scale == "reduced":
        config = build_model("qwen2_5_vl", tok, "tiny").config
    else:
        entry = ARCHITECTURES[recipe.arch]
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in dict(
            image_token_id="<|image_pad|>", video_token_id="<|video_pad|>", vision_start_token_id="<|vision_start|>",
            vision_end_token_id="<|vision_end|>").items()}
        conf = dict(entry["config"])
        conf["text_config"] = {**conf["text_config"], "bos_token_id": tok.pad_token_id,
                               "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        config = getattr(transformers, entry["class"].replace("ForConditionalGeneration", "Config"))(**conf, **ids)
    cls = transformers.Qwen2_5_VLForConditionalGeneration
    return build_module(cls, config, dtype, device), build_processor("qwen2_5_vl", tok, frame_pixels)


def write_stub(folder: str, pipe=None, config=None) -> str:
    """A model folder of configs only: a pipeline's model_index.json and each component's config (flow), or a
    transformers config.json (token). What load_flow_model checks and what `mmrl plan` reads; never weights."""
    import transformers

    os.makedirs(folder, exist_ok=True)
    if config is not None:
        config.save_pretrained(folder)
        return folder
    index = {"_class_name": type(pipe).__name__,
             **{k: list(v) if isinstance(v, tuple) else v for k, v in pipe.config.items() if not k.startswith("_")}}
    for name, part in pipe.components.items():
        if part is None:
            continue
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        if isinstance(part, transformers.PreTrainedModel):
            part.config.save_pretrained(os.path.join(folder, name))
        elif hasattr(part, "save_config"):
            part.save_config(os.path.join(folder, name))
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return folder


def write_videos(root: str, scale: str) -> list[str]:
    """Charades-STA files of 3 videos (2 train, 1 test): 30 s of 640 x 480 at 4 fps ("real", what Charades_v1_480
    holds), or 8 s of 56 x 56 at 2 fps; a colored square moving over gray. Returns the task.kwargs override."""
    import numpy as np

    from tasks.grounding_world import write_mp4

    seconds, fps, (h, w) = (30, 4, (480, 640)) if scale == "real" else (8, 2, (56, 56))
    vdir = os.path.join(root, "videos")
    os.makedirs(vdir, exist_ok=True)
    for split, ids in (("train", ["RS000", "RS001"]), ("test", ["RS002"])):
        with open(os.path.join(root, f"ann_{split}.txt"), "w") as f:
            f.writelines(f"{v} 2.0 {seconds / 2:.1f}##the person opens the door.\n" for v in ids)
        with open(os.path.join(root, f"dur_{split}.csv"), "w") as f:
            f.write("id,length\n" + "".join(f"{v},{seconds:.2f}\n" for v in ids))
        for k, v in enumerate(ids):
            frames = np.full((seconds * fps, h, w, 3), 128, dtype=np.uint8)
            side = h // 4
            for t in range(len(frames)):
                x = (t * 7 + 31 * k) % (w - side)
                frames[t, h // 3:h // 3 + side, x:x + side] = (200, 40 + 60 * k, 40)
            write_mp4(os.path.join(vdir, v + ".mp4"), frames, fps)
    kw = {"format": "charades_sta", "annotations": os.path.join(root, "ann_train.txt"),
          "durations": os.path.join(root, "dur_train.csv"), "video_dir": vdir,
          "eval_annotations": os.path.join(root, "ann_test.txt"), "eval_durations": os.path.join(root, "dur_test.csv"),
          "missing_video": "skip"}
    return [f"task.kwargs={json.dumps(kw)}", "task.eval_prompts=1"]


# ------------------------------------------------------------------------------------------------------- measuring
class PhaseMeter:
    """Peak memory and wall time per phase: `switch(phase)` closes the current one (its peak since its start, kept
    as the largest over its segments; its seconds added to the current iteration's) and opens the next (None: none).
    CUDA: max_memory_allocated, reset at each switch; CPU: VmHWM reset through clear_refs, minus `base`."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.peak: dict[str, float] = {}                     # phase -> MiB
        self.seconds: dict[tuple[int, str], float] = {}      # (iteration, phase) -> s
        self.phase, self.iteration, self.t0 = None, -1, 0.0
        self.base = 0 if self.cuda else _reset_cpu_peak()

    def switch(self, phase: str | None) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.phase is not None:
            if self.cuda:
                mib = torch.cuda.max_memory_allocated() / 2**20
            else:
                from mmrl.testing.memory import rss_kib

                mib = (rss_kib("VmHWM") - self.base) / 1024
            self.peak[self.phase] = max(self.peak.get(self.phase, 0.0), mib)
            key = (self.iteration, self.phase)
            self.seconds[key] = self.seconds.get(key, 0.0) + now - self.t0
        if phase is not None:
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            else:
                _reset_cpu_peak()
            self.t0 = time.perf_counter()
        self.phase = phase

    @contextlib.contextmanager
    def during(self, phase: str, after: str | None = "other"):
        self.switch(phase)
        try:
            yield
        finally:
            self.switch(after)

    def wrap(self, fn, phase: str, after: str | None = "other", iteration=None):
        def wrapped(*args, **kwargs):
            if iteration is not None:
                self.iteration = iteration()
            with self.during(phase, after):
                return fn(*args, **kwargs)
        return wrapped


def _reset_cpu_peak() -> int:
    from mmrl.testing.memory import reset_peak

    return reset_peak()


def peak_flops(device: str) -> tuple[float, str]:
    """(dense bf16 peak FLOP/s of the device, what it is)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # GH200 before H200
            if key in name:
                return PEAK_FLOPS[key], f"{name}: {PEAK_FLOPS[key] / 1e12:.0f} TFLOP/s dense bf16"
        return 989e12, f"{name}: unknown, nominal 989 TFLOP/s"
    threads = torch.get_num_threads()
    return NOMINAL_CPU_FLOPS * threads, f"CPU: nominal {NOMINAL_CPU_FLOPS / 1e9:.0f} GFLOP/s x {threads} thread(s)"


def _plan_job(config: str, overrides: list[str], prompt_tokens: int | None, device: str, threads: int) -> dict:
    """`mmrl plan` of the run's own configuration (its stub folder's configs), world 1, measured on fake tensors."""
    from mmrl.compose import load_config
    from mmrl.plan import plan

    torch.set_num_threads(threads)
    cfg = load_config(os.path.join(ROOT, "configs", config + ".yaml"), overrides)
    return plan(cfg, None, prompt_tokens, world=1, measured=True, device="cuda" if device.startswith("cuda") else "cpu")


class Plans:
    """`_plan_job`s in worker processes beside the GPU work (workers=0: in this process, when asked for)."""

    def __init__(self, workers: int):
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) if workers else None
        self.threads = max(1, (os.cpu_count() or 2) // max(workers, 1) // 2) if workers else torch.get_num_threads()
        self.jobs: dict[str, object] = {}

    def submit(self, name: str, *args) -> None:
        if self.pool is not None:
            self.jobs[name] = self.pool.submit(_plan_job, *args, self.threads)
        else:
            self.jobs[name] = args

    def result(self, name: str) -> dict:
        job = self.jobs[name]
        try:
            return job.result() if self.pool is not None else _plan_job(*job, self.threads)
        except Exception as e:  # noqa: BLE001 - the measured figures still stand; the plan's failure is named
            return {"error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# ------------------------------------------------------------------------------------------------------ one recipe
def overrides(config: str, recipe: Recipe, scale: str, device: str, stub: str, out_dir: str, extra: list[str]):
    return [*(recipe.real if scale == "real" else recipe.reduced), *extra, f"model.path={stub}",
            f"model.device={device}", "model.dtype=bfloat16", "train.mixed_precision=bf16", "train.parallel=none",
            "train.gradient_checkpointing=true", "train.iterations=2", "train.time_budget_min=0",
            f"reward.name={__name__}:StandInReward", "reward.kwargs={}", f"log.out_dir={out_dir}",
            "log.tensorboard=false", "log.progress=false", "log.eval_at_start=false", "log.eval_every=0",
            "log.image_every=0", "log.save_every=2", "log.keep_checkpoints=1"]


def run_recipe(config: str, scale: str, device: str, tmp: str, plans: Plans, settings: tuple[str, ...] = ()) -> dict:
    """Two iterations of `config` through Trainer.fit at `scale`, a save, and a new Trainer resuming it; measured per
    phase (see the module docstring). Returns the recipe's row of the report, without the plan's figures."""
    import mmrl.policy.token as token_mod
    import mmrl.trainer as trainer_mod
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    recipe, dtype = RECIPES[config], torch.bfloat16
    name = config.replace("/", "_")
    stub, out_dir = os.path.join(tmp, name, "model"), os.path.join(tmp, name, "run")
    token = config.startswith("grounding/")
    extra = write_videos(os.path.join(tmp, name, "data"), scale) if token else []
    over = overrides(config, recipe, scale, device, stub, out_dir, [*extra, *settings])
    cfg = load_config(os.path.join(ROOT, "configs", config + ".yaml"), over)
    if cfg.task.name == "prompt_file":  # the recipe's prompt files are not here: a few prompts of ours
        prompts = os.path.join(tmp, name, "prompts.txt")
        os.makedirs(os.path.dirname(prompts), exist_ok=True)
        with open(prompts, "w") as f:
            f.write("\n".join(PROMPTS) + "\n")
        over += [f"task.prompt_file={prompts}", f"task.kwargs={json.dumps({'eval_file': prompts})}",
                 "task.eval_prompts=1"]
        cfg = load_config(os.path.join(ROOT, "configs", config + ".yaml"), over)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(trainer_mod, "MAX_NONFINITE_STEPS", 10**9))  # counted, not fatal
        if token:
            frame = cfg.video.max_pixels or 3136
            meta_model, _ = build_token_model(recipe, scale, dtype, "meta", frame)
            write_stub(stub, config=meta_model.config)
            del meta_model
            stack.enter_context(mock.patch.object(
                token_mod, "load_token_model",
                lambda path, dtype_, device_, trust=False: build_token_model(recipe, scale, dtype_, device_, frame)))
        else:
            import sys

            from mmrl.models.families import all_architectures

            write_stub(stub, pipe=build_pipeline(recipe, scale, dtype, "meta"))
            plans.submit(config, config, over, None, device)
            family = all_architectures()[recipe.arch]["family"]
            stack.enter_context(mock.patch.object(
                sys.modules[family.load.__module__], "from_pretrained",
                lambda folder, index, options: build_pipeline(recipe, scale, options.dtype, options.device)))
        gc.collect()
        meter = PhaseMeter(device)
        nonfinite, prompts = [0], []
        with meter.during("startup"):
            tr = Trainer(cfg)
        it = lambda: tr.iteration  # noqa: E731
        sample = tr.policy.sample

        def sampled(*args, **kwargs):
            out = sample(*args, **kwargs)
            prompts.extend(out.examples[:1])
            return out

        tr.policy.sample = meter.wrap(sampled, "sampling", iteration=it)
        if not token:
            tr.policy.model.decode = meter.wrap(tr.policy.model.decode, "decode", after="sampling")
        tr.optimize = meter.wrap(tr.optimize, "training", iteration=it)
        tr.save = meter.wrap(tr.save, "save", iteration=it)
        step_optimizer = tr.step_optimizer

        def counted(stats):
            ok = step_optimizer(stats)
            nonfinite[0] += 1 - ok
            return ok

        tr.step_optimizer = counted
        tr.evaluate = lambda step: {}  # the check is memory and throughput
        tr.fit()
        meter.switch(None)
        prompt_tokens = int(tr.policy.encode_prompt(prompts[0])["input_ids"].shape[1]) if token else None
        if token:
            plans.submit(config, config, over, prompt_tokens, device)
        del tr, sample, step_optimizer
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        meter.iteration = -1
        with meter.during("resume", None):
            tr = Trainer(cfg)
            if not tr.resume():
                raise RuntimeError(f"no checkpoint to resume in {out_dir}/checkpoints after 2 iterations")
            resumed_at = tr.iteration
        del tr
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    lines = [r for r in map(json.loads, open(os.path.join(out_dir, "metrics.jsonl"))) if "perf/iteration_s" in r]
    timed = max(i for i, p in meter.seconds if p == "sampling")  # the last iteration sampled
    phases = {}
    for phase in PHASES:
        if phase in meter.peak:  # per iteration: the timed one's; start-up, save and resume: their last
            secs = [s for (i, p), s in meter.seconds.items() if p == phase and
                    (i == timed or phase not in ("sampling", "decode", "training"))]
            phases[phase] = {"peak_mib": meter.peak[phase], "seconds": secs[-1]}
    return {"arch": recipe.arch, "scale": scale, "overrides": over[:len(recipe.real if scale == "real" else
                                                                         recipe.reduced)],
            "phases": phases, "iteration_s": [r["perf/iteration_s"] for r in lines],
            "nonfinite_steps": nonfinite[0], "optimizer_steps": sum(r.get("train/optimizer_steps", 0) for r in lines),
            "resumed_at_iteration": resumed_at, "prompt_tokens": prompt_tokens}


def add_plan(res: dict, plan: dict, flops: float) -> dict:
    """The plan's figure beside each measured phase, and MFU of sampling and training."""
    res["plan_error"] = plan.get("error") or plan.get("measure_error")
    for phase, row in res["phases"].items():
        key = PLAN_KEYS.get(phase)
        gib = plan.get(key) if key else (plan["startup_gib"] + plan["adamw_state_fp32_gib"] + plan["ema_fp32_gib"]
                                         if "startup_gib" in plan else None)
        row["plan_mib"] = gib * 1024 if gib is not None else None
    for kind in ("sampling", "training"):
        tflop, secs = plan.get(f"tflop_per_iter_{kind}"), res["phases"].get(kind, {}).get("seconds")
        res[f"tflop_{kind}"] = tflop
        res[f"mfu_{kind}"] = tflop * 1e12 / (secs * flops) if tflop is not None and secs else None
    res["plan_params"] = plan.get("params")
    return res


def table(results: dict, flops_note: str) -> str:
    f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    head = (f"{'recipe':34s} {'phase':9s} {'peak MiB':>10s} {'plan MiB':>10s} {'seconds':>9s} {'non-finite':>10s} "
            f"{'MFU':>8s}")
    lines = [head, "-" * len(head)]
    for config, res in results.items():
        if not res.get("ok"):
            lines.append(f"{config:34s} FAILED: {res['error'].splitlines()[0]}")
            continue
        for phase, row in res["phases"].items():
            nf = str(res["nonfinite_steps"]) if phase == "training" else "-"
            mfu = f(res.get(f"mfu_{phase}"), ".1%") if phase in ("sampling", "training") else "-"
            lines.append(f"{config:34s} {phase:9s} {row['peak_mib']:10.0f} {f(row['plan_mib'], '10.0f'):>10s} "
                         f"{row['seconds']:9.2f} {nf:>10s} {mfu:>8s}")
        lines.append(f"{config:34s} {'s / iter':9s} {'':10s} {'':10s} {res['iteration_s'][-1]:9.2f} "
                     f"{res['nonfinite_steps']:>10d} {'':8s}")
        if res.get("plan_error"):
            lines.append(f"{config:34s} plan: {res['plan_error'].splitlines()[0]}")
    peak = "resident peak (VmHWM) over the recipe's start" if "CPU" in flops_note \
        else "torch.cuda.max_memory_allocated"
    lines.append(f"MFU against {flops_note}; peak: {peak}; plan: mmrl plan of the same configuration (world 1, fake "
                 f"tensors); seconds: the timed iteration")
    return "\n".join(lines)


def run(configs: list[str], device: str, scale: str, plan_workers: int | None = None, tmp: str | None = None,
        settings: tuple[str, ...] = ()) -> dict:
    """Every recipe of `configs` (RECIPES keys) at `scale` ("real" | "reduced") on `device`, with the config
    overrides `settings` (e.g. train.compile=true); the report as a dict."""
    flops, note = peak_flops(device)
    workers = plan_workers if plan_workers is not None else min(len(configs), max(0, (os.cpu_count() or 1) // 4))
    plans, results = Plans(workers), {}
    with contextlib.ExitStack() as stack:
        root = tmp or stack.enter_context(tempfile.TemporaryDirectory(prefix="mmrl-real-size-"))
        try:
            for config in configs:
                t0 = time.time()
                try:
                    results[config] = {**run_recipe(config, scale, device, root, plans, settings), "ok": True}
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # noqa: BLE001 - report every recipe (DCP raises BaseException)
                    results[config] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc()[-3000:]}
                results[config]["wall_s"] = time.time() - t0
                print(f"{config}: {'done' if results[config]['ok'] else results[config]['error'].splitlines()[0]} "
                      f"({results[config]['wall_s']:.0f} s)", flush=True)
            for config, res in results.items():
                if res["ok"]:
                    add_plan(res, plans.result(config), flops)
        finally:
            plans.close()
    return {"ok": bool(results) and all(r["ok"] for r in results.values()), "device": device, "scale": scale,
            "peak_flops": flops, "peak_flops_note": note, "recipes": results}


def main(args) -> int:
    """scripts/gpu_check.py --real-size: args.device, args.only, args.scale, args.set (overrides)."""
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check --real-size: no CUDA device here; run it on a GPU machine (or --device cpu for the dry run)")
        print(json.dumps({"ok": False, "device": device, "error": "no CUDA device"}))
        return 2
    scale = getattr(args, "scale", None) or ("real" if device.startswith("cuda") else "reduced")
    configs = [c for c in RECIPES if not args.only or any(w in c for w in args.only)]
    t0 = time.time()
    report = run(configs, device, scale, settings=tuple(getattr(args, "set", None) or ()))
    report["wall_s"] = time.time() - t0
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    print(table(report["recipes"], report["peak_flops_note"]))
    print(f"{len(configs)} recipe(s) at {scale} size on {device} in {report['wall_s']:.0f} s")
    print(json.dumps(report))
    return 0 if report["ok"] else 1
