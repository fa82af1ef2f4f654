"""Preemption: SIGTERM (a cluster taking the node back) and SIGINT (Ctrl-C) end a run with a checkpoint.

The first signal only raises a flag: the trainer finishes the iteration it is in, every rank learns of the flag
at the same iteration boundary (`Distributed.decide`: one collective, so a signal that reached one rank stops all of
them), saves, and exits with status 128 + the signal's number and a line saying how to resume. A second signal
exits at once, saving nothing. torchrun forwards its own SIGTERM / SIGINT to every worker; its grace period before
SIGKILL must cover the rest of an iteration and a save (schedulers: send the signal early, e.g. SLURM's
`--signal=TERM@300`).

A torchrun restart (`--max-restarts`) of a run whose workers died resumes from the newest intact checkpoint by
itself (`restarted()`), without `--resume` on the first command line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Raised after the checkpoint of a signalled run is written: exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.message = signum, message


class StopRequests:
    """Within the block, SIGTERM and SIGINT set `self.signum` instead of killing the process (main thread only:
    Python delivers signals there); the previous handlers come back afterwards."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
        return False

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: no save, no wait
            print(f"mmrl: second {signal.Signals(signum).name}: exiting now without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum = signum
        log.warning("%s received: finishing this iteration, then saving a checkpoint and exiting (send it again to "
                    "exit at once)", signal.Signals(signum).name)


def restarted() -> int:
    """How many times torchrun has restarted this job's workers (TORCHELASTIC_RESTART_COUNT; 0 for a first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def stop_run(trainer, signum: int | None) -> None:
    """A signal reached some rank of `trainer` (mmrl.trainer.Trainer): every rank saves the iteration just finished
    (unless it is saved) and exits with 128 + the signal's number (`Preempted`); the run continues with --resume, or
    by itself under a torchrun restart."""
    signum = trainer.dist.broadcast_object(signum) or int(signal.SIGTERM)  # rank 0 may not have been signalled
    path = trainer.saved_path
    if trainer.iteration and trainer.saved_at != trainer.iteration:  # the same branch on every rank (a collective)
        path = trainer.save()
    trainer.logger.close()
    trainer.collect.close()
    name = signal.Signals(signum).name
    msg = (f"stopped by {name} after iteration {trainer.iteration}; checkpoint {path}. Continue with the same command "
           f"and --resume") if trainer.iteration else f"stopped by {name} before the first iteration; nothing saved"
    if trainer.dist.main:
        log.warning("%s", msg)
    trainer.dist.close()
    raise Preempted(signum, msg)
