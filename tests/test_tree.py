"""BranchGRPO tree rollouts (docs/algorithms.md §3): the tree's structure and densities, its advantages against a
brute-force enumeration of small trees, pruning, the policy contract and the trainer on trees."""

import itertools
import math

import pytest
import torch

from mmrl.algorithms import ADVANTAGES
from mmrl.compose import load_config
from mmrl.data import Rollout, group_ids
from mmrl.rollout.tree import run_tree, trained_steps, tree_advantages
from mmrl.sampling.flow_sde import gaussian_log_prob, step_mean_std

from test_flow_policy import EXAMPLES, make_policy

S = 6
SIGMAS = torch.linspace(1, 0, S + 1)


def velocity(x, s, tree):  # a smooth stand-in for the transformer: depends on the state, sigma and the prompt
    return 0.3 * x + (s + tree.float()).view(-1, 1, 1)


def grow(splits, branch=2, b=2, kinds=None, scale=1.0, seed=0):
    kinds = kinds or ["flow_grpo"] * (S - 1) + ["ode"]
    x = torch.randn(b, 2, 3, generator=torch.Generator().manual_seed(99))
    return run_tree(velocity, x, SIGMAS, kinds, splits, branch, 0.7, torch.Generator().manual_seed(seed),
                    split_noise_scale=scale), kinds


def test_tree_structure_calls_and_densities():
    tr, kinds = grow([1, 3], branch=2, scale=4.0)
    n = 2 * 4
    assert tr.latents.shape == (n, S + 1, 2, 3) and tr.node.shape == (n, S)
    # one transformer row per alive path and step: 1, 1 (split -> 2), 2, 2 (split -> 4), 4, 4 per tree
    assert tr.calls == 2 * (1 + 1 + 2 + 2 + 4 + 4)
    assert tr.depth.tolist() == [0, 1, 1, 2, 2, 2]
    leaves = tr.latents.view(2, 4, S + 1, 2, 3)
    # all leaves of a tree share x_0 .. x_1; siblings of the first split share x_2 .. x_3 pairwise
    assert torch.equal(leaves[:, :, :2], leaves[:, :1, :2].expand(-1, 4, -1, -1, -1))
    assert torch.equal(leaves[:, 0, 2:4], leaves[:, 1, 2:4]) and not torch.equal(leaves[:, 1, 2:4], leaves[:, 2, 2:4])
    assert not torch.equal(leaves[:, 0, 4], leaves[:, 1, 4])
    # children of a split share the parent's mean (one prediction), differ in noise
    assert torch.equal(tr.mean[0, 1], tr.mean[2, 1]) and torch.equal(tr.mean[0, 3], tr.mean[1, 3])
    # the log-prob is the density of the stored transition under the stored mean and (scaled) std
    for i in range(S - 1):
        lp = gaussian_log_prob(tr.latents[:, i + 1], tr.mean[:, i], tr.std[:, i])
        assert torch.allclose(lp, tr.log_prob[:, i], atol=1e-5)
    for i, scale in ((1, 4.0), (2, 1.0)):  # step 1 is a split (noise std x4), step 2 is not
        zero = torch.zeros(n, 1)
        _, std = step_mean_std("flow_grpo", zero, zero, SIGMAS[i].expand(n), SIGMAS[i + 1].expand(n), 0.7,
                               float(SIGMAS[1]))
        assert torch.allclose(tr.std[:, i], scale * std)
    # node ids: shared by the leaves on one segment, distinct across trees
    assert tr.node[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(set(tr.node[:, 1].tolist())) == 4 and len(set(tr.node[:, 5].tolist())) == 8
    assert trained_steps(kinds, [1, 3]) == [1, 2, 3, 4]


def test_tree_is_deterministic_and_rejects_bad_splits():
    a, _ = grow([0, 2])
    b, _ = grow([0, 2])
    assert torch.equal(a.latents, b.latents)
    with pytest.raises(ValueError, match="split_steps"):
        grow([0, 5])  # the last step is never trained, so it cannot branch
    with pytest.raises(ValueError, match="SDE"):
        grow([0, 2], kinds=["ode"] * S)


# ---------------------------------------------------------------------------------------- advantages
def tree_cfg(*items):
    return load_config(None, ["tree.split_steps=[1, 3]", "train.group_size=4", "algo.loss_agg=token_mean",
                              "algo.adv_eps=1e-8", *items])


def tree_rollout(splits=(1, 3), kinds=None, seed=0):
    tr, kinds = grow(list(splits), kinds=kinds, seed=seed)
    w = torch.tensor(trained_steps(kinds, list(splits)))
    n, a = tr.node.shape[0], len(w)
    return Rollout(group_id=group_ids(2, 4), old_log_prob=tr.log_prob[:, w], action_mask=torch.ones(n, a, dtype=torch.bool),
                   examples=[{}] * n, outputs=None,
                   extras={"tree_node": tr.node[:, w], "tree_depth": tr.depth[w].expand(n, -1).clone(),
                           "step_index": w.expand(n, -1).clone()})


def brute_force(rewards, valid, logp_edge, fusion, alpha=1.0):
    """Advantage of every node of the two 2x2 trees by explicit enumeration: node = (tree, depth, prefix of
    branch choices); leaf l of tree t has choices (l // 2, l % 2)."""
    def leaves(t, prefix):
        return [t * 4 + c0 * 2 + c1 for c0, c1 in itertools.product(range(2), repeat=2)
                if (c0, c1)[:len(prefix)] == prefix and valid[t * 4 + c0 * 2 + c1]]

    def reward(t, prefix):
        if fusion == "mean" or len(prefix) == 2:
            ls = leaves(t, prefix)
            return sum(rewards[l] for l in ls) / len(ls) if ls else None
        kids = [(c, reward(t, prefix + (c,))) for c in range(2)]
        kids = [(c, r) for c, r in kids if r is not None]
        lp = [alpha * logp_edge[(t, prefix + (c,))] for c, _ in kids]
        z = [math.exp(v - max(lp)) for v in lp]
        return sum(zi / sum(z) * r for zi, (_, r) in zip(z, kids))

    adv = {}
    for t, d in itertools.product(range(2), (1, 2)):
        nodes = {p: reward(t, p) for p in itertools.product(range(2), repeat=d)}
        nodes = {p: r for p, r in nodes.items() if r is not None}
        vals = list(nodes.values())
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for p, r in nodes.items():
            adv[(t, p)] = (r - mean) / (std + 1e-8) if len(vals) > 1 else 0.0
    return adv


@pytest.mark.parametrize("fusion", ["mean", "softmax"])
@pytest.mark.parametrize("dead", [None, 5])
def test_tree_advantages_match_brute_force(fusion, dead):
    ro = tree_rollout()
    rewards = torch.tensor([0.9, 0.1, 0.4, 0.4, 0.0, 1.0, 0.3, 0.7])
    valid = torch.ones(8, dtype=torch.bool)
    if dead is not None:
        valid[dead] = False
    # the split-edge log-prob of each child node: action 0 is step 1 (first split), action 2 is step 3
    logp = {}
    for l in range(8):
        t, c0, c1 = l // 4, (l % 4) // 2, l % 2
        logp[(t, (c0,))] = float(ro.old_log_prob[l, 0])
        logp[(t, (c0, c1))] = float(ro.old_log_prob[l, 2])
    want = brute_force(rewards.tolist(), valid.tolist(), logp, fusion, alpha=2.0)
    cfg = tree_cfg(f"tree.fusion={fusion}", "tree.fusion_alpha=2.0")
    adv, stats = tree_advantages(rewards, ro, valid, cfg, ADVANTAGES["grpo"], 0)
    steps = ro.extras["step_index"][0].tolist()   # [1, 2, 3, 4]
    for l in range(8):
        t, c0, c1 = l // 4, (l % 4) // 2, l % 2
        for j, s in enumerate(steps):
            prefix = (c0,) if s < 3 else (c0, c1)
            if (t, prefix) in want:
                assert adv[l, j].item() == pytest.approx(want[(t, prefix)], abs=1e-5), (l, s)
    # each (node, step) transition is trained exactly once, by a valid leaf
    mask = ro.action_mask
    for j in range(4):
        trained = ro.extras["tree_node"][mask[:, j], j].tolist()
        alive = set(ro.extras["tree_node"][valid, j].tolist())
        assert sorted(trained) == sorted(alive)
    assert not mask[~valid].any()
    assert stats["tree/trained_transitions"] == mask.sum().item() == (2 + 2 + 4 + 4) * 2 - 2 * (dead is not None)


# Pruning against the reference's rules (train_one_step_tree of fastvideo/train_branchgrpo_flux.py,
# Fredreic1849/BranchGRPO), each expected set written out by hand. The reference's transition at step s has child
# depth s + 1; it trains every step, the last (19 of 20) included; here steps 0 .. 18 from the first split on are the
# actions and step 19 is the ODE step to the clean sample. Default tree: 20 steps, splits 0, 3, 6, 9 (16 leaves).
def pruned_tree(*items, splits=(0, 3, 6, 9), steps=20, rewards=None, iteration=0):
    """(steps trained by some leaf, {leaf: its trained steps after the last split}) of one tree."""
    sig, kinds = torch.linspace(1, 0, steps + 1), ["flow_grpo"] * (steps - 1) + ["ode"]
    x = torch.randn(1, 1, 2, generator=torch.Generator().manual_seed(3))
    tr = run_tree(velocity, x, sig, kinds, list(splits), 2, 0.7, torch.Generator().manual_seed(0))
    w = torch.tensor(trained_steps(kinds, list(splits)))
    g = 2 ** len(splits)
    ro = Rollout(group_id=group_ids(1, g), old_log_prob=tr.log_prob[:, w], action_mask=torch.ones(g, len(w), dtype=torch.bool),
                 examples=[{}] * g, outputs=None,
                 extras={"tree_node": tr.node[:, w], "tree_depth": tr.depth[w].expand(g, -1).clone(),
                         "step_index": w.expand(g, -1).clone()})
    cfg = load_config(None, [f"tree.split_steps={list(splits)}", f"train.group_size={g}", "algo.loss_agg=token_mean",
                             f"sampler.num_steps={steps}", "train.iterations=1000", *items])
    rewards = torch.arange(g, dtype=torch.float) if rewards is None else rewards
    tree_advantages(rewards, ro, torch.ones(g, dtype=torch.bool), cfg, ADVANTAGES["grpo"], iteration)
    m = ro.action_mask
    union = {int(s) for s in w[m.any(0)]}
    post = {leaf: {int(s) for s in w[m[leaf]] if s > max(splits)} for leaf in range(g)}
    return union, post


ALL = set(range(19))  # the actions of the default tree: steps 0 .. 18


def test_depth_pruning_fixed():
    # --depth_pruning 15,16,17,18 = steps 14, 15, 16, 17: trained 0..13 and 18
    assert pruned_tree("tree.prune_steps=[14, 15, 16, 17]")[0] == ALL - {14, 15, 16, 17}


@pytest.mark.parametrize("iteration, pruned", [
    (0, {14, 15, 16, 17}),   # reference step 1: shift 1 // 2 = 0
    (1, {13, 14, 15, 16}),   # step 2: shift 1
    (4, {12, 13, 14, 15}),   # step 5: shift 2
    (100, {8, 9, 10, 11}),   # step 101: shift 50, capped at depth 15 - stop depth (last split) 9 = 6: depths 9..12
])
def test_depth_pruning_sliding(iteration, pruned):
    union, _ = pruned_tree("tree.prune_steps=[14, 15, 16, 17]", "tree.prune_slide_every=2", iteration=iteration)
    assert union == ALL - pruned


def test_depth_pruning_stop_depth():
    # --depth_pruning_stop_depth 12 = prune_slide_stop 11: shift capped at 15 - 12 = 3, depths 12..15 = steps 11..14
    union, _ = pruned_tree("tree.prune_steps=[14, 15, 16, 17]", "tree.prune_slide_every=1", "tree.prune_slide_stop=11",
                           iteration=50)
    assert union == ALL - {11, 12, 13, 14}


def test_width_pruning_mode_1():
    # each leaf's post-split transitions: steps 10..19, n = 10, keep int(10 x 0.5) = 5 = steps 10..14 (all equal in
    # advantage, the stable sort keeps them in step order); 15..18 dropped (19 kept by the reference, untrainable here)
    union, post = pruned_tree("tree.width_prune=1", "tree.width_ratio=0.5")
    assert union == ALL - {15, 16, 17, 18}
    assert all(steps == {10, 11, 12, 13, 14} for steps in post.values())


def test_depth_then_width_mode_1():
    # depth pruning first: post-split steps left 10, 11, 12, 13, 18, 19: n = 6, keep 3 = 10, 11, 12
    union, _ = pruned_tree("tree.prune_steps=[14, 15, 16, 17]", "tree.width_prune=1", "tree.width_ratio=0.5")
    assert union == set(range(13))
    # sliding late (depths 9..12 = steps 8..11 pruned) with width: post steps 12..19, n = 8, keep 4 = 12..15
    union, _ = pruned_tree("tree.prune_steps=[14, 15, 16, 17]", "tree.prune_slide_every=2", "tree.width_prune=1",
                           "tree.width_ratio=0.5", iteration=100)
    assert union == set(range(8)) | {12, 13, 14, 15}
    # pruning the last step (--depth_pruning 20) takes it out of the count: steps 10..18, n = 9, keep 4 = 10..13
    union, _ = pruned_tree("tree.prune_steps=[19]", "tree.width_prune=1", "tree.width_ratio=0.5")
    assert union == set(range(14))


# leaf l's reward 5 l mod 16: best leaves 3 (15), 6 (14), 9 (13), 12 (12); worst 0 (0), 13 (1), 10 (2), 7 (3)
SCRAMBLED = torch.tensor([(5 * leaf) % 16 for leaf in range(16)], dtype=torch.float)


def test_width_pruning_mode_2():
    # 16 leaves x 10 post-split transitions (10..19) = 160, ranked by the leaf's advantage, ties in step order;
    # keep int(160 x 0.3) = 48: the best 24 = leaves 3, 6 (all 10) + leaf 9's first 4 (10..13); the worst 24 = the
    # last 24 of the ranking = leaf 10's last 4 (16..19) + leaves 13, 0 (all 10); step 19 is never trained here
    _, post = pruned_tree("tree.width_prune=2", "tree.width_ratio=0.3", rewards=SCRAMBLED)
    full = set(range(10, 19))
    expected = {3: full, 6: full, 9: {10, 11, 12, 13}, 10: {16, 17, 18}, 13: full, 0: full}
    assert post == {leaf: expected.get(leaf, set()) for leaf in range(16)}


def test_depth_then_width_mode_2():
    # depth pruning leaves 10, 11, 12, 13, 18, 19: 16 x 6 = 96, keep int(96 x 0.25) = 24: best 12 = leaves 3, 6;
    # worst 12 = leaves 13, 0
    union, post = pruned_tree("tree.prune_steps=[14, 15, 16, 17]", "tree.width_prune=2", "tree.width_ratio=0.25",
                              rewards=SCRAMBLED)
    kept = {10, 11, 12, 13, 18}
    assert post == {leaf: kept if leaf in (3, 6, 13, 0) else set() for leaf in range(16)}
    assert union == ALL - {14, 15, 16, 17}


def test_prune_iter_ratio():
    # train.iterations 10 x 0.5 = 5: the reference's steps 1..5 (iterations 0..4) prune, step 6 on does not
    items = ("tree.prune_steps=[14, 15, 16, 17]", "tree.width_prune=1", "tree.prune_iter_ratio=0.5",
             "train.iterations=10")
    assert pruned_tree(*items, iteration=4)[0] == set(range(13))
    assert pruned_tree(*items, iteration=5)[0] == ALL


def test_split_rounds():
    # parse_split_points: interval num_steps // rounds, rounds i x interval
    cfg = load_config(None, ["tree.split_rounds=4", "sampler.num_steps=20", "train.group_size=16",
                             "algo.loss_agg=token_mean"])
    assert cfg.tree.split_steps == [0, 5, 10, 15]
    cfg = load_config(None, ["tree.split_rounds=3", "sampler.num_steps=20", "train.group_size=8",
                             "algo.loss_agg=token_mean"])
    assert cfg.tree.split_steps == [0, 6, 12]
    # the same rule written out is accepted again (a saved config reloads)
    load_config(None, ["tree.split_rounds=3", "tree.split_steps=[0, 6, 12]", "sampler.num_steps=20",
                       "train.group_size=8", "algo.loss_agg=token_mean"])
    with pytest.raises(ValueError, match="set one of them"):
        load_config(None, ["tree.split_rounds=2", "tree.split_steps=[0, 3]", "sampler.num_steps=20",
                           "train.group_size=4", "algo.loss_agg=token_mean"])
    with pytest.raises(ValueError, match="fewer rounds"):  # 10 rounds of 10 steps: a split on the last step 9
        load_config(None, ["tree.split_rounds=10", "sampler.num_steps=10", "train.group_size=1024",
                           "algo.loss_agg=token_mean"])


def test_pruning_config_errors():
    base = ["tree.split_steps=[0, 1]", "train.group_size=4", "algo.loss_agg=token_mean"]
    with pytest.raises(ValueError, match="prune_slide_every > 0"):
        load_config(None, base + ["tree.prune_steps=[4]", "tree.prune_slide_stop=2"])
    with pytest.raises(ValueError, match="min\\(prune_steps\\)"):
        load_config(None, base + ["tree.prune_steps=[4]", "tree.prune_slide_every=1", "tree.prune_slide_stop=5"])
    with pytest.raises(ValueError, match="depth_pruning lists depths"):
        load_config(None, base + ["tree.prune_steps=[10]"])
    with pytest.raises(ValueError, match="prune_iter_ratio"):
        load_config(None, base + ["tree.prune_iter_ratio=1.5"])


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="group_size=4"):
        load_config(None, ["tree.split_steps=[0, 1]", "algo.loss_agg=token_mean"])
    with pytest.raises(ValueError, match="loss_agg=token_mean"):
        load_config(None, ["tree.split_steps=[0, 1, 2]", "train.group_size=8"])
    with pytest.raises(ValueError, match="split_steps"):
        load_config(None, ["tree.split_steps=[0, 9]", "train.group_size=4", "algo.loss_agg=token_mean"])


# ------------------------------------------------------------------------------------------ the policy
def tree_policy(path, **over):
    return make_policy(path, **{"tree.split_steps": "[0,2]", "train.group_size": 4, "algo.loss_agg": "token_mean",
                                **over})


@pytest.mark.parametrize("window", [0, 1])  # 1 = BranchGRPO-Mix: SDE on a 1-step window and the splits
def test_tree_policy_contract(tiny_pixel_model, window):
    pol = tree_policy(tiny_pixel_model, **{"sampler.sde_window_size": window, "sampler.cfg_scale": 2.0,
                                           "tree.split_noise_scale": 2.0})
    ro = pol.sample(EXAMPLES, 4, torch.Generator().manual_seed(0))
    n = 8
    a = ro.old_log_prob.shape[1]
    steps = ro.extras["step_index"][0].tolist()
    assert ro.outputs.shape == (n, 3, 24, 24) and ro.group_id.tolist() == [0] * 4 + [1] * 4
    assert {0, 2} <= set(steps) and max(steps) <= 3 and (window or steps == [0, 1, 2, 3])
    assert torch.equal(pol.sample(EXAMPLES, 4, torch.Generator().manual_seed(0)).outputs, ro.outputs)
    # on-policy ratio = 1 on every computed action, and only the masked actions are computed
    ro.action_mask[:, :] = False
    ro.action_mask[0, :] = True
    ro.action_mask[5, a - 1] = True
    out = pol.log_prob(ro, torch.arange(n))
    assert (out.log_prob - ro.old_log_prob).abs().max() < 1e-5
    calls = []
    h = pol.transformer.register_forward_pre_hook(lambda m, args, kw: calls.append(kw["hidden_states"].shape[0]),
                                                  with_kwargs=True)
    pol.log_prob(ro, torch.arange(n))
    h.remove()
    assert calls == [a + 1, a + 1]  # a + 1 trained actions: CFG's unconditional rows without autograd, then the
    # conditional ones (sampler.cfg_grad=cond)


def test_tree_trains_through_the_trainer(tiny_pixel_model, tmp_path):
    from mmrl.trainer import Trainer

    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false", "train.iterations=1",
        "log.eval_at_start=false", "tree.split_steps=[0,1]", "train.group_size=4", "algo.loss_agg=token_mean",
        "tree.prune_steps=[2]", "tree.width_prune=2", "algo.ratio=guard", "algo.weighting=tempflow+guard_dt"])
    m = Trainer(cfg).step(0)
    assert all(math.isfinite(v) for v in m.values())
    # trees of 4 leaves: depth 1 has 2 nodes, depth 2 has 4; steps 0 and 1 are splits, step 2 pruned
    assert m["tree/nodes"] == 2 * (2 + 4) and m["tree/trained_transitions"] == 2 * (2 + 4)
