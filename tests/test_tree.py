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


def test_depth_and_width_pruning():
    ro = tree_rollout()
    rewards = torch.tensor([0.9, 0.1, 0.4, 0.5, 0.0, 1.0, 0.3, 0.7])
    valid = torch.ones(8, dtype=torch.bool)
    step = ro.extras["step_index"]
    cfg = tree_cfg("tree.prune_steps=[2]")
    tree_advantages(rewards, ro, valid, cfg, ADVANTAGES["grpo"], 0)
    assert not ro.action_mask[step == 2].any() and ro.action_mask[step == 4].sum() == 8
    # sliding (splits 0, 1; steps 0..4 trained): one step earlier every 2 iterations, never onto the last split
    ro2 = tree_rollout(splits=(0, 1))
    step2 = ro2.extras["step_index"]
    cfg = tree_cfg("tree.split_steps=[0, 1]", "tree.prune_steps=[4]", "tree.prune_slide_every=2")
    for it, pruned in ((1, 4), (2, 3), (100, 2)):
        tree_advantages(rewards, ro2, valid, cfg, ADVANTAGES["grpo"], it)
        assert not ro2.action_mask[step2 == pruned].any()
        assert ro2.action_mask[(step2 >= 2) & (step2 != pruned)].all()
    # width mode 2: post-split steps (> 3, i.e. step 4) trained only by the best and worst leaves
    cfg = tree_cfg("tree.width_prune=2", "tree.width_ratio=0.5")
    adv, _ = tree_advantages(rewards, ro, valid, cfg, ADVANTAGES["grpo"], 0)
    kept = ro.action_mask[:, 3].nonzero().squeeze(-1).tolist()
    order = torch.argsort(adv[:, 3], descending=True, stable=True).tolist()
    assert sorted(kept) == sorted(order[:2] + order[-2:])
    assert ro.action_mask[:, :3].sum() == 2 * (2 + 2 + 4)  # earlier steps untouched
    # width mode 1 on a longer post-split segment: each leaf keeps the first half of its post-split steps
    ro = tree_rollout(splits=(0, 1))
    cfg = tree_cfg("tree.split_steps=[0, 1]", "tree.width_prune=1", "tree.width_ratio=0.5")
    tree_advantages(rewards, ro, valid, cfg, ADVANTAGES["grpo"], 0)
    assert ro.extras["step_index"][0].tolist() == [0, 1, 2, 3, 4]
    assert ro.action_mask[:, 2:].sum(0).tolist() == [8, 0, 0]  # 3 post-split steps, int(3 * 0.5) = 1 kept


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
