"""The import graph has layers and no arrow points up: the config is a leaf, the core never imports a plugin
(rewards/, tasks/), and only the composition module turns names into objects. Function-level imports count."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mmrl", "rewards", "tasks")

def read_layers() -> list[list[str]]:
    """docs/architecture.md's ```layers block: one layer per line starting with its number ("N title: modules"),
    continued on indented lines; low -> high."""
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    block = doc.split("```layers\n", 1)[1].split("```", 1)[0]
    layers: list[list[str]] = []
    for line in block.splitlines():
        if line[:1].isdigit():
            assert int(line.split()[0]) == len(layers), line
            layers.append(line.split(":", 1)[1].split())
        elif line.strip():
            layers[-1] += line.split()
    return layers


# low -> high; a module may import modules of its own layer or below (and the whole graph is acyclic).
# "x.*" is the package x and everything under it. The list lives in docs/architecture.md, its one place.
LAYERS = read_layers()


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


def test_the_trainer_reads_top_to_bottom_and_knows_no_modality():
    """The loop reads top to bottom: no function of the trainer over 60 lines, and no modality or policy kind named
    (what a kind can do is asked of its declaration, mmrl/policy/kinds.py)."""
    src = open(os.path.join(ROOT, "mmrl", "trainer.py")).read()
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert long == []
    code = "\n".join(line.split("#")[0] for line in src.splitlines())  # comments may name examples
    for word in ("tree", "flow", "vlm", "token", "janus", "image", "isinstance(rollout.outputs"):
        assert word not in code.replace("image_every", ""), word
