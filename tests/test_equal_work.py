"""Equal work on every rank (issue 43): minibatches stratified by group, a rank's groups of a sampling call (chunks,
refills of fewer groups than ranks, FSDP padding), and zero-weight padding passes of one micro-batch. In process;
the 2-process equality of the same paths is tests/test_distributed.py's."""

import torch

from mmrl.compose import load_config
from mmrl.data import Rollout, stratified_minibatches
from mmrl.parallel.distributed import Distributed
from mmrl.trainer import Trainer


def test_minibatches_take_every_groups_share_seeded_and_world_independent():
    gid = torch.arange(6).repeat_interleave(8)                               # [48] B = 6 groups of G = 8
    chunks = stratified_minibatches(gid, 4, torch.Generator().manual_seed(3))
    assert sorted(torch.cat(chunks).tolist()) == list(range(48))             # every row once
    for c in chunks:                                                         # G / minibatches = 2 of every group
        assert torch.bincount(gid[c], minlength=6).tolist() == [2] * 6
    again = stratified_minibatches(gid, 4, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(chunks, again))             # seeded
    other = stratified_minibatches(gid, 4, torch.Generator().manual_seed(4))
    assert not all(torch.equal(a, b) for a, b in zip(chunks, other))         # the seed picks the rows
    # 2 ranks holding groups 0-2 and 3-5 (contiguous, as Distributed.sample shards them): 8 rows each per minibatch
    # (a global permutation cut in 4 chunks gives 6 against 6 only on average: e.g. 5 against 7)
    for c in chunks:
        assert int((gid[c] < 3).sum()) == int((gid[c] >= 3).sum()) == 6


def test_uneven_groups_spread_within_one_row():
    gid = torch.tensor([0] * 5 + [1] * 3 + [2] * 4 + [3] * 4)              # [16] trees / injected rows: sizes differ
    chunks = stratified_minibatches(gid, 3, torch.Generator().manual_seed(0))
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    counts = torch.stack([torch.bincount(gid[c], minlength=4) for c in chunks])  # [3 minibatches, 4 groups]
    assert (counts.max(0).values - counts.min(0).values).max() <= 1


class RecordingPolicy:
    """Samples one row per (group, member) and records which groups it was asked for."""

    samples_rows = True

    def __init__(self):
        self.calls = []

    def sample(self, examples, group_size, gen, rows=None):
        rows = torch.arange(len(examples) * group_size) if rows is None else rows
        gid = rows // group_size                                             # [n] the row's group
        self.calls.append(gid[::group_size].tolist())                        # the groups sampled (copies too)
        return Rollout(group_id=gid, old_log_prob=torch.zeros(len(rows), 2), action_mask=torch.ones(len(rows), 2,
                       dtype=torch.bool), examples=[examples[g] for g in gid.tolist()], outputs=rows.float())


def as_rank(rank: int, world: int, parallel: str) -> Distributed:
    d = Distributed()
    d.rank, d.world, d.parallel = rank, world, parallel
    return d


def test_a_rank_samples_its_share_of_the_whole_batch_in_every_chunk_and_pads():
    ex = [{"prompt": str(i)} for i in range(5)]
    # a whole batch of 5 groups on 2 ranks: 2 and 3 groups; FSDP pads rank 0 with a copy (dropped)
    for parallel, forwards in (("ddp", [2, 3]), ("fsdp", [3, 3])):
        got = []
        for r in range(2):
            pol = RecordingPolicy()
            ro = as_rank(r, 2, parallel).sample(pol, ex, 2, torch.Generator())
            got.append(sorted(set(ro.group_id.tolist())))
            assert len(pol.calls[0]) == forwards[r], (parallel, r, pol.calls)
        assert got == [[0, 1], [2, 3, 4]]
    # the same batch in chunks [0, 1] and [2, 3, 4] (reward.overlap_chunks): every group stays on its rank
    for r, want in ((0, [[0, 1], []]), (1, [[], [2, 3, 4]])):
        d, pol = as_rank(r, 2, "fsdp"), RecordingPolicy()
        chunks = [d.sample(pol, ex[lo:hi], 2, torch.Generator(), lo, 5) for lo, hi in ((0, 2), (2, 5))]
        assert [sorted(set(c.group_id.tolist()) - {-1}) for c in chunks] == want
        assert [len(c) for c in pol.calls] == [2, 3]                         # as many sampled groups on both ranks
        for c, w in zip(chunks, want):
            if not w:  # no group of this chunk: one padding row, group id -1
                assert c.group_id.tolist() == [-1]


def test_a_refill_of_fewer_groups_than_ranks_pads_the_rank_without_one():
    ex = [{"prompt": "x"}]
    for parallel in ("ddp", "fsdp"):
        rows = []
        for r in range(2):
            pol = RecordingPolicy()
            rows.append(as_rank(r, 2, parallel).sample(pol, ex, 3, torch.Generator()).group_id.tolist())
            assert len(pol.calls) == 1 and len(pol.calls[0]) == 1              # one group sampled on each rank
        assert rows == [[-1], [0, 0, 0]]


def test_a_padding_pass_is_one_micro_batch(tiny_pixel_model, tmp_path):
    """A rank with fewer passes than another runs zero-weight ones: each scores at most train.micro_batch actions
    (one real micro-batch), not every trained action of a row."""
    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false",
        "log.eval_at_start=false", "train.micro_batch=2", "sampler.num_steps=6"])
    tr = Trainer(cfg)
    tr.dist.max_int = lambda n: n + 2                                        # another rank needs 2 more passes
    scored, row_actions, log_prob = [], [], tr.policy.log_prob

    def recording(rollout, index, actions=None):
        mask = rollout.action_mask[index] if actions is None else rollout.action_mask[index] & actions
        scored.append(int(mask.sum()))
        row_actions.append(int(rollout.action_mask[index].sum(-1).max()))
        return log_prob(rollout, index, actions=actions)

    tr.policy.log_prob = recording
    m = tr.step(0)
    assert torch.isfinite(torch.tensor(m["train/loss"]))
    assert min(row_actions) > 2                          # a whole row would be more than one micro-batch
    assert max(scored) <= 2, scored                      # real and padding passes alike
    assert len(scored) >= 2 * cfg.train.minibatches      # the padding passes ran (2 per minibatch)
