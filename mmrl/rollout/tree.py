"""BranchGRPO tree rollouts for flow policies (arXiv 2509.06040; docs/algorithms.md §3).

Sampling (`run_tree`). Each prompt starts from ONE noise (the root). At every split step each alive path
evaluates the transformer once and its `branch` children share that prediction, differing only in the injected
noise; between splits a path has one child. After D splits a tree has L = branch ** D leaves, the group.
Nodes are the segments between splits: the node of a leaf at step i is the path it is on after step i, so a
node at depth d (d splits done) covers steps split_d .. split_{d+1} - 1.

Training (`tree_advantages`). The rows of the rollout are the leaves (outputs, rewards); its actions are the
trained steps, and each (leaf, step) is the transition of the node the leaf is on. A node's reward fuses its
leaves (mean, or bottom-up softmax over the children's split-edge log-probs); node advantages are
group-relative among the nodes of one tree at one depth (the configured estimator, e.g. grpo z-scores: the
reference's depth-wise advantage). Every transition is trained once, by the first valid leaf below it (the
other leaves' copies are masked), with its node's advantage. Pruning only removes transitions from training.

Where the reference code differs (documented, not copied):
- its split noise is multiplied by split_noise_scale while the log-prob keeps the unscaled std, an off-policy
  term hidden in every split edge; here the stored std IS the scaled one, so the log-prob is the density the
  child was drawn from and the on-policy ratio stays exactly 1;
- it z-scores with the unbiased std; the estimator here uses the population std of docs/algorithms.md §2 (a constant
  factor sqrt((n - 1) / n) on the depth's advantages);
- the last step is the ODE step to the clean sample here, never trained, where the reference draws it as an SDE
  edge and trains it; pruning counts it as the reference does (width pruning's n) but cannot train it when kept;
- width pruning mode 2 ranks the transitions of the whole iteration (every rank's trees), the reference those of
  one rank's training step.
Pruning follows train_one_step_tree of fastvideo/train_branchgrpo_flux.py (Fredreic1849/BranchGRPO) rule for
rule otherwise (tests/test_tree.py, hand-computed trees): `_pruned`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from mmrl.algorithms.advantages import ADVANTAGES, group_credit
from mmrl.errors import ConfigError
from mmrl.sampling.flow_sde import Trajectory, step

FUSIONS = ("mean", "softmax")  # tree.fusion


@dataclass
class Tree(Trajectory):
    """B trees, leaf-major: rows t * L .. t * L + L - 1 are the leaves of tree t. The Trajectory fields hold
    each leaf's path (shared prefixes repeated; std scaled on split steps); S steps."""

    node: torch.Tensor       # [N, S] long     global id of the node owning step i of the leaf's path
    depth: torch.Tensor      # [S] long        splits done at or before step i (0 = the root segment)
    calls: int               # transformer rows evaluated (one per node and step, x2 with CFG inside velocity)


def split_schedule(num_steps: int, splits: list[int]) -> list[bool]:
    """[S] True at split steps; splits must be distinct and leave the last (untrained) step alone."""
    bad = [s for s in splits if not 0 <= s < num_steps - 1]
    if bad or len(set(splits)) != len(splits):
        raise ConfigError(f"tree.split_steps={splits}: need distinct steps in [0, num_steps - 2 = {num_steps - 2}]")
    return [i in splits for i in range(num_steps)]


@torch.no_grad()
def run_tree(velocity, x: torch.Tensor, sigmas: torch.Tensor, kinds: list[str], splits: list[int], branch: int,
             noise_level: float, generator: torch.Generator | None = None, reduce: str = "mean",
             split_noise_scale: float = 1.0, progress: bool = False) -> Tree:
    """Grow B trees from roots x [B, *D]. velocity(x [M, *D], sigma [M], tree [M] long) -> v [M, *D] evaluates
    the M alive paths of step i in one call. kinds[i] is step i's sampler; split steps must not be "ode".
    generator: one for all paths, or a list of B (one per tree: its paths draw from it in order, so a tree's noise
    does not depend on the other trees of the batch)."""
    is_split = split_schedule(len(kinds), splits)
    if any(kinds[i] == "ode" for i in splits):
        raise ConfigError("tree split steps must be SDE steps")
    sigma_max = float(sigmas[1])
    b = x.shape[0]
    tree = torch.arange(b)                    # [M] tree of each alive path
    node = torch.arange(b)                    # [M] global node id of each alive path
    next_id, depth, calls = b, 0, 0
    states, parents, outs = [x], [], []
    for i, kind in enumerate(tqdm(kinds, desc="tree rollout", leave=False, disable=not progress)):
        m = x.shape[0]
        sig, sig_next = sigmas[i].expand(m).to(x.device), sigmas[i + 1].expand(m).to(x.device)
        v = velocity(x, sig, tree)
        calls += m
        k = branch if is_split[i] else 1
        parent = torch.arange(m).repeat_interleave(k)                                  # [M * k]
        gens = [generator[i] for i in tree[parent].tolist()] if isinstance(generator, list) else generator
        out = step(kind, x[parent], v[parent], sig[parent], sig_next[parent], noise_level, sigma_max, gens,
                   reduce, split_noise_scale if is_split[i] else 1.0)                 # children share v
        tree = tree[parent]
        if is_split[i]:
            node = torch.arange(next_id, next_id + m * k)
            next_id, depth = next_id + m * k, depth + 1
        else:
            node = node[parent]
        x = out.next
        states.append(x)
        parents.append(parent)
        outs.append((out.mean, torch.as_tensor(out.std).expand(len(parent)), out.log_prob, node, depth))
    # index of each leaf's path after step i, walking back from the leaves
    s, n = len(kinds), x.shape[0]
    after = [None] * s
    idx = torch.arange(n)
    for i in range(s - 1, -1, -1):
        after[i] = idx
        idx = parents[i][idx]
    lat = [states[0][idx]] + [states[i + 1][after[i]] for i in range(s)]
    return Tree(latents=torch.stack(lat, 1),
                mean=torch.stack([outs[i][0][after[i]] for i in range(s)], 1),
                std=torch.stack([outs[i][1][after[i]] for i in range(s)], 1),
                log_prob=torch.stack([outs[i][2][after[i]] for i in range(s)], 1),
                node=torch.stack([outs[i][3][after[i]] for i in range(s)], 1),
                depth=torch.tensor([outs[i][4] for i in range(s)]), calls=calls)


def trained_steps(kinds: list[str], splits: list[int]) -> list[int]:
    """The actions of a tree rollout: SDE steps from the first split on, never the last step (steps before the
    first split belong to the root, the only node of its depth, whose advantage is always 0)."""
    return [i for i in range(min(splits), len(kinds) - 1) if kinds[i] != "ode"]


# ------------------------------------------------------------------------------------------------- training
def _first_valid_owner(node: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, A] bool: for each column, the first valid row of every node id in it."""
    n, a = node.shape
    owner = torch.zeros(n, a, dtype=torch.bool)
    rows = valid.nonzero().squeeze(-1)
    for j in range(a):
        ids = node[rows, j]
        uniq, inv = torch.unique(ids, return_inverse=True)
        first = torch.full((len(uniq),), n, dtype=torch.long).scatter_reduce_(0, inv, rows, "amin")
        owner[first, j] = True
    return owner


def tree_credit(rewards: dict, weights: dict | None, rollout, valid: torch.Tensor, cfg, iteration: int):
    """The `tree` credit assignment (CREDIT_ASSIGNMENTS): per-transition advantages [N, A] of a tree rollout,
    with the group statistics of its leaves logged beside the tree's."""
    _, stats = group_credit(rewards, weights, rollout, valid, cfg, iteration)
    adv, tree_stats = tree_advantages(rewards["overall"], rollout, valid, cfg, ADVANTAGES[cfg.algo.advantage], iteration)
    return adv, {**stats, **tree_stats}


tree_credit.reads_extras = ("tree_node", "tree_depth", "step_index")  # gathered across ranks with the rewards


def tree_advantages(rewards: torch.Tensor, rollout, valid: torch.Tensor, cfg, estimator, iteration: int):
    """Per-transition advantages [N, A] of a tree rollout and its trained-action mask (set on rollout).

    rewards [N] leaf rewards; rollout.extras: tree_node [N, A], tree_depth [N, A], step_index [N, A];
    cfg: the whole Config (cfg.tree: fusion, pruning; cfg.algo: the estimator's options); estimator: an
    ADVANTAGES function applied to node rewards grouped by (tree, depth).
    """
    t = cfg.tree
    node, depth, step = (rollout.extras[k].long() for k in ("tree_node", "tree_depth", "step_index"))
    n, a = node.shape
    gid = torch.unique(rollout.group_id, return_inverse=True)[1]                        # [N] dense tree ids
    node = gid.unsqueeze(-1) * (int(node.max()) + 1) + node  # unique across trees of concatenated rollouts
    d_max = int(depth.max())
    # path[l, d] = the node leaf l is on at depth d (1 .. D); every depth >= 1 has an action (its split step)
    path = torch.stack([node[:, (depth[0] == d).nonzero()[0, 0]] for d in range(1, d_max + 1)], 1)   # [N, D]
    uniq, inv = torch.unique(path, return_inverse=True)                                 # node k = uniq[k]
    k = len(uniq)
    w = valid.double()
    r = torch.where(valid, rewards.double(), torch.zeros_like(rewards, dtype=torch.double))
    cnt = torch.zeros(k, dtype=torch.double).index_add_(0, inv.flatten(), w.repeat_interleave(d_max))
    node_valid = cnt > 0
    node_depth = torch.zeros(k, dtype=torch.long).index_put_((inv.flatten(),), torch.arange(1, d_max + 1).repeat(n))
    node_tree = torch.zeros(k, dtype=torch.long).index_put_((inv.flatten(),), gid.repeat_interleave(d_max))
    if t.fusion == "mean":
        node_r = torch.zeros(k, dtype=torch.double).index_add_(0, inv.flatten(), r.repeat_interleave(d_max))
        node_r = node_r / cnt.clamp(min=1)
    elif t.fusion == "softmax":
        node_r = _softmax_fusion(r, valid, inv, depth, step, rollout.old_log_prob, cfg)
    else:
        raise ConfigError(f"tree.fusion must be 'mean' or 'softmax', got {t.fusion!r}")
    groups = node_tree * (d_max + 1) + node_depth
    node_adv, est_stats = estimator(node_r.float(), groups, node_valid, cfg.algo)      # [K]
    stats = {f"tree/node_{key.split('/')[-1]}": v for key, v in est_stats.items()}
    col_adv = torch.zeros(n, a)
    for d in range(1, d_max + 1):
        cols = depth[0] == d
        col_adv[:, cols] = node_adv[inv[:, d - 1]].unsqueeze(-1)
    owned = _first_valid_owner(node, valid) & (depth > 0)
    mask = owned & ~_pruned(step, col_adv, valid, cfg, iteration)
    stats.update({"tree/nodes": float(k), "tree/transitions": float(owned.sum()),
                  "tree/trained_transitions": float(mask.sum())})
    rollout.action_mask = mask
    return col_adv, stats


def _softmax_fusion(r, valid, inv, depth, step, old_log_prob, cfg):
    """Bottom-up R(node) = sum_c softmax_c(alpha * logp(split edge of c)) R(c); leaves keep their reward."""
    n, d_max = inv.shape
    k = int(inv.max()) + 1
    node_r = torch.zeros(k, dtype=torch.double)
    node_r[inv[:, -1]] = r
    ok = torch.zeros(k, dtype=torch.bool)
    ok[inv[:, -1]] = valid
    for d in range(d_max - 1, 0, -1):  # parents at depth d, children at depth d + 1
        split_col = (depth[0] == d + 1).nonzero()[0, 0]
        child, parent = inv[:, d], inv[:, d - 1]
        lp = torch.zeros(k, dtype=torch.double)
        lp[child] = old_log_prob[:, split_col].double()
        uc, first = torch.unique(child, return_inverse=True)
        par_of = torch.zeros(len(uc), dtype=torch.long).index_put_((first,), parent)
        logits = torch.where(ok[uc], cfg.tree.fusion_alpha * lp[uc], torch.full_like(lp[uc], -torch.inf))
        for p in torch.unique(par_of):
            sel = par_of == p
            if ok[uc[sel]].any():
                wts = torch.softmax(logits[sel], 0)
                node_r[p] = (wts * torch.where(ok[uc[sel]], node_r[uc[sel]], torch.zeros_like(wts))).sum()
                ok[p] = True
    return node_r


def pruned_steps(t, iteration: int) -> list[int]:
    """The steps depth pruning removes at `iteration` (0-based): tree.prune_steps, slid (iteration + 1) //
    prune_slide_every steps earlier (the reference's training steps count from 1) while the shallowest stays at or
    after prune_slide_stop (default: the step before the last split, the reference's stop depth = last split)."""
    if not t.prune_steps:
        return []
    shift = (iteration + 1) // t.prune_slide_every if t.prune_slide_every > 0 else 0
    stop = t.prune_slide_stop if t.prune_slide_stop is not None else max(t.split_steps) - 1
    shift = min(shift, max(min(t.prune_steps) - stop, 0))
    return sorted(s - shift for s in t.prune_steps)


def prunes_at(cfg, iteration: int) -> bool:
    """Pruning (depth and width) applies while iteration + 1 <= int(train.iterations x tree.prune_iter_ratio)."""
    return iteration + 1 <= int(cfg.train.iterations * cfg.tree.prune_iter_ratio)


def _pruned(step: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, cfg, iteration: int) -> torch.Tensor:
    """[N, A] bool: transitions left out of training by depth pruning, then width pruning (train_one_step_tree).

    Width pruning works on each leaf's transitions after the last split that depth pruning left, in step order,
    counting the last step (num_steps - 1): the reference trains it as an SDE edge, here it is the ODE step to the
    clean sample, never an action, so it is counted and, when kept, simply not trained. Their advantage is the
    leaf's along the whole segment, so the reference's stable sort by advantage keeps them in step order."""
    t = cfg.tree
    out = torch.zeros_like(step, dtype=torch.bool)
    if not prunes_at(cfg, iteration):
        return out
    gone = pruned_steps(t, iteration)
    out |= torch.isin(step, torch.tensor(gone, dtype=step.dtype))
    if not t.width_prune:
        return out
    last_split, last = max(t.split_steps), cfg.sampler.num_steps - 1
    assert bool((step == step[:1]).all()), "tree actions are the same steps for every leaf"
    post = [s for s in step[0].tolist() if s > last_split and s not in gone] + ([last] if last not in gone else [])
    if not post:
        return out
    col = {s: j for j, s in enumerate(step[0].tolist())}
    drop = torch.zeros_like(out)
    if t.width_prune == 1:     # each leaf keeps its first max(1, int(n x ratio)) post-split transitions
        keep = max(1, int(len(post) * t.width_ratio))
        for s in post[keep:]:
            if s in col:
                drop[:, col[s]] = True
    else:                      # of the batch's post-split transitions, the best and the worst by advantage
        rows = valid.nonzero().squeeze(-1).tolist()
        leaf_adv = adv[:, -1]  # the last action is the last split or after it: its node is the leaf
        entries = [(r, s) for r in rows for s in post]                    # the reference's order: leaf, then step
        order = sorted(range(len(entries)), key=lambda e: -float(leaf_adv[entries[e][0]]))  # stable: ties in order
        keep = max(2, int(len(entries) * t.width_ratio))
        best = keep // 2
        kept = set(order[:best]) | set(order[len(order) - (keep - best):])
        for e, (r, s) in enumerate(entries):
            if e not in kept and s in col:
                drop[r, col[s]] = True
    return out | drop
