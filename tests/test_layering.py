"""The import graph has layers and no arrow points up: the config is a leaf, the core never imports a plugin
(rewards/, tasks/), and only the composition module turns names into objects. Function-level imports count."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mmrl", "rewards", "tasks")

# low -> high; a module may import modules of its own layer or below (and the whole graph is acyclic).
# "x.*" is the package x and everything under it.
LAYERS = [
    # 0 leaves: import nothing from mmrl (config_files: only the config; any: the user errors, preemption)
    ["mmrl", "mmrl.policy.kinds", "mmrl.shards", "mmrl.errors", "mmrl.devices", "mmrl.preemption", "mmrl.seeds", "mmrl.train_stats", "mmrl.registry", "mmrl.config", "mmrl.config_files", "mmrl.cache", "mmrl.data",
     "mmrl.metrics", "mmrl.optim", "mmrl.testing",
     "mmrl.testing.fake_device", "mmrl.testing.family", "mmrl.testing.janus", "mmrl.models", "mmrl.models.architectures", "mmrl.models.pixel_t2i",
     "mmrl.models.qwen_vl", "mmrl.sampling.*", "mmrl.rollout", "mmrl.rollout.engine",
     "mmrl.context_parallel"],
    # 1 building blocks: algorithms, models, samplers, rollout engines
    ["mmrl.video", "mmrl.algorithms.*", "mmrl.models.flow_model", "mmrl.models.pipelines", "mmrl.models.shard_load", "mmrl.models.decode_batch", "mmrl.models.families.*",
     "mmrl.models.tiny_pipelines", "mmrl.rollout.vllm_engine",
     "mmrl.rollout.contrast",
     "mmrl.rollout.tree", "mmrl.rollout.step_branch"],
    # 2 the interfaces and their registries
    ["mmrl.policy.*", "mmrl.reward", "mmrl.task", "mmrl.rollout.pairwise", "mmrl.distributed", "mmrl.compiled", "mmrl.evaluation", "mmrl.report",
     "mmrl.rollout.collect"],
    # 3 plugins: the built-in rewards and tasks, which mmrl reaches only through registry strings; a reward may
    #   import a task (its world's vocabulary), never the reverse (test_tasks_never_import_rewards)
    ["rewards.*", "tasks.*"],
    # 4 composition: config names -> objects; checkpoint files; the plan of a config at real size (the trainer reads it
    #   for train.micro_batch=auto)
    ["mmrl.compose", "mmrl.checkpoint", "mmrl.checkpoint_state", "mmrl.plan", "mmrl.plan_models", "mmrl.plan_measure",
     "mmrl.plan_rows", "mmrl.micro_batch"],
    # 5 the loop, the reward server
    ["mmrl.trainer", "mmrl.reward_server", "mmrl.runs"],
    # 6 tools on top of the loop
    ["mmrl.export", "mmrl.testing.memory",
     "mmrl.testing.contract", "mmrl.testing.tiny_rewards", "mmrl.testing.real_size",
     "mmrl.eval", "mmrl.sample", "mmrl.preflight"],
    # 7 the command line
    ["mmrl.cli"],
]


def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def imports(path: str, mods: dict) -> set[str]:
    """Modules of `mods` that the file imports anywhere (module level or inside functions)."""

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    me = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parent = me.split(".")[:-node.level] if not me.endswith("__init__") else me.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            out |= {resolve(f"{base}.{a.name}") or resolve(base) for a in node.names}
    return {m for m in out if m} - {me.removesuffix(".__init__")}


def layer_of(name: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        for pat in layer:
            if name == pat or (pat.endswith(".*") and (name == pat[:-2] or name.startswith(pat[:-1]))):
                return i
    return None


MODS = modules()
GRAPH = {m: imports(p, MODS) for m, p in MODS.items()}


def test_every_module_has_a_layer():
    assert [m for m in MODS if layer_of(m) is None] == []


def test_no_upward_imports():
    upward = [f"{m} (layer {layer_of(m)}) -> {d} (layer {layer_of(d)})" for m, deps in GRAPH.items() for d in deps
              if layer_of(d) is not None and layer_of(m) is not None and layer_of(d) > layer_of(m)]
    assert upward == []


def test_the_import_graph_is_acyclic():
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m, stack):
        state[m] = 1
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_the_config_is_a_leaf_and_the_core_never_imports_a_plugin():
    assert GRAPH["mmrl.config"] <= {"mmrl.errors"}  # the user errors, themselves a leaf
    assert GRAPH["mmrl.errors"] == set()
    core = [m for m in MODS if m.startswith("mmrl") and layer_of(m) <= 2]
    assert [(m, d) for m in core for d in GRAPH[m] if not d.startswith("mmrl")] == []


def test_tasks_never_import_rewards():
    """A reward scores a world's outputs, so it may read the world's vocabulary (rewards -> tasks); a task, its
    dataset and its benchmark metric never need a reward (the benchmark's scoring lives with the reward)."""
    top = {m: m.partition(".")[0] for m in MODS}
    assert sorted((m, d) for m in MODS if top[m] == "tasks" for d in GRAPH[m] if top[d] == "rewards") == []


def test_the_checker_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from mmrl.trainer import Trainer\n")
    assert imports(str(f), MODS) == {"mmrl.trainer"}


def test_every_lazy_registry_entry_imports():
    """Built-in plugins are registered as "package.module:Name" strings; each one must resolve."""
    from mmrl import algorithms, policy, reward, task
    from mmrl.registry import Registry
    from mmrl.rollout import pairwise

    registries = [v for mod in (algorithms, policy, reward, task, pairwise) for v in vars(mod).values()
                  if isinstance(v, Registry)]
    assert len(registries) >= 12
    for reg in registries:
        for name in list(reg):
            assert callable(reg[name]), f"{reg.axis} {name!r}"


def test_the_trainer_reads_in_one_sitting_and_knows_no_modality():
    src = open(os.path.join(ROOT, "mmrl", "trainer.py")).read()
    assert len(src.splitlines()) < 350
    code = "\n".join(line.split("#")[0] for line in src.splitlines())  # comments may name examples
    for word in ("tree", "flow", "vlm", "image", "isinstance(rollout.outputs"):
        assert word not in code.replace("image_every", ""), word
