"""Every seed mmrl derives from `train.seed`, in one place: `derive_seed(seed, stream, *counters)`.

Each consumer draws from its own named stream, so two consumers never share a random sequence and none depends on
the order the others ran in (resuming needs no RNG state: a seed is a function of the run's seed and counters such as
the iteration). The mixing is a multiply-add by a prime per counter, modulo 2**63 (a valid torch.Generator seed):

    derive_seed(s, stream, c1, c2) = ((STREAMS[stream] x P + s) x P + c1) x P + c2   (mod 2**63),  P = 1_000_003
"""

from __future__ import annotations

PRIME = 1_000_003
# a stream per consumer; a new consumer adds its name here (never reuse a number: it would replay another's draws;
# 3 and 4 were the row streams below before they moved there)
STREAMS = {"iteration": 1, "minibatches": 2, "contrast": 5, "lora_init": 6, "branch_noise": 7}
# a sampled row's own streams, from the row's seed (a flow chain's SDE noise, a forward-process objective's noise
# levels): row_seed(seed, stream) = seed x P + offset (mod 2**63), the row's noise whichever process samples it
ROW_STREAMS = {"step_noise": 12_345, "forward_noise": 54_321}


def row_seed(seed: int, stream: str) -> int:
    """The seed of a sampled row's `stream` (a ROW_STREAMS name) from the row's seed."""
    return (int(seed) * PRIME + ROW_STREAMS[stream]) % 2**63


def derive_seed(seed: int, stream: str, *counters: int) -> int:
    """The seed of `stream` (a STREAMS name) for run seed `seed` at `counters` (iteration, epoch, row seed ...)."""
    if stream not in STREAMS:
        raise KeyError(f"unknown seed stream {stream!r}; known: {sorted(STREAMS)} (add new ones to mmrl.seeds.STREAMS)")
    x = STREAMS[stream]
    for c in (seed, *counters):
        x = (x * PRIME + int(c)) % 2**63
    return x
