"""train.compile: regional compilation of the trained networks' repeated transformer blocks.

Each block is compiled in place with `nn.Module.compile` (the block's `__call__` goes through `torch.compile`), as
diffusers' `ModelMixin.compile_repeated_blocks` does (PyTorch's regional-compilation recipe,
https://docs.pytorch.org/tutorials/recipes/regional_compilation.html): the blocks of one class share one compiled
graph (their weights are its inputs), so compiling costs about one block per block class, not the whole model. In
place means no `torch.compile(module)` wrapper: module names, `state_dict` keys, peft adapter names and FSDP2 units
stay what they are, so checkpoints written with and without compilation are the same files.

Which blocks: the classes a diffusers model declares in `_repeated_blocks` (diffusers' own list), else the items
of the outermost block lists (`mmrl.parallel.shards.transformer_blocks`: diffusers `transformer_blocks`, transformers
decoder `layers`, vision `blocks`). Classes are matched through the MRO, so FSDP2's renamed block classes
(`FSDP<Block>`) and DDP's wrapper are seen through; diffusers' `compile_repeated_blocks` matches the class name
alone and finds nothing under FSDP2, which is why it is not called directly.

The compiled regions trace what runs inside a block's call: its LoRA layers (compile after the adapters are
added), gradient checkpointing (diffusers and transformers checkpoint around the block's call), FSDP2's hooks.
`dynamic=None`: the first call of a shape compiles it static; a second shape recompiles with dynamic sizes (batch
chunks, CFG-doubled rows and token lengths vary from call to call).
"""

from __future__ import annotations

import logging
import shutil

import torch

from mmrl.parallel.shards import transformer_blocks
from mmrl.errors import ConfigError

log = logging.getLogger(__name__)
# compiled variants kept per block class (grad on / off, adapters on / off, train / eval, static / dynamic
# shapes): torch's default (8) is shared by every compiled block of the process, as they share one code object
RECOMPILES_PER_CLASS = 16


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of `module` (a diffusers / transformers model, possibly wrapped by DDP or
    peft, or sharded by FSDP2): those of its `_repeated_blocks` classes when a model inside declares them, else
    `transformer_blocks(module)`."""
    declared = {name for m in module.modules() for name in (getattr(m, "_repeated_blocks", None) or ())}
    if declared:
        found = [m for m in module.modules() if any(c.__name__ in declared for c in type(m).__mro__)]
        if found:
            return found
    return transformer_blocks(module)


def compile_blocks(modules: list[torch.nn.Module], device: torch.device, **compile_kwargs) -> list[torch.nn.Module]:
    """Compile, in place, the repeated blocks of each of `modules` (see the module docstring); returns them.
    compile_kwargs go to `torch.compile` (backend, mode, dynamic; default: inductor). Raises ConfigError when a
    module has no blocks to compile, or inductor would need a C++ compiler on the CPU and none is installed."""
    backend = compile_kwargs.get("backend", "inductor")
    if backend == "inductor" and torch.device(device).type == "cpu":
        check_cpu_compiler()
    blocks = []
    for module in modules:
        found = repeated_blocks(module)
        if not found:
            raise ConfigError(f"train.compile: no repeated transformer blocks found in {type(module).__name__} (no "
                              f"_repeated_blocks classes, no ModuleList named like layers / blocks): set "
                              f"train.compile=false")
        blocks.extend(found)
    classes = {type(b) for b in blocks}
    limit = RECOMPILES_PER_CLASS * len(classes)
    if torch._dynamo.config.recompile_limit < limit:
        torch._dynamo.config.recompile_limit = limit
    for b in blocks:
        b.compile(**compile_kwargs)
    log.info("train.compile: %d blocks of %s compiled in place (regional compilation)", len(blocks),
             sorted(c.__name__ for c in classes))
    return blocks


def compile_policy(policy, train) -> list[torch.nn.Module]:
    """train.compile: the repeated blocks of the policy's trained networks, compiled in place (call it once LoRA and
    DDP / FSDP2 wrapping are done: they run inside the blocks); nothing when it is off. Returns the blocks."""
    return compile_blocks(policy.trainable_modules(), policy.device) if train.compile else []


def check_cpu_compiler() -> None:
    """Inductor compiles C++ for the CPU: fail before the first forward (not inside it) when there is no compiler."""
    from torch._inductor import cpp_builder

    cxx = cpp_builder.get_cpp_compiler()
    if not shutil.which(cxx):
        raise ConfigError(f"train.compile on the CPU: torch inductor needs a C++ compiler ({cxx!r} is not on the PATH; "
                          f"install g++, or set CXX), or set train.compile=false")
