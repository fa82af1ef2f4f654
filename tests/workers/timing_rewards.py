"""Reward plugins that misbehave in time, for tests/test_preemption.py (named `timing_rewards:NAME` with this folder
on PYTHONPATH). Each scores an image by its mean brightness (a signal the tiny model can follow).

- Late: rank 1 takes MMRL_TEST_LATE_S seconds longer to build it (a reward model that loads slower on one rank).
- Preempt: at the call of iteration MMRL_TEST_SIGNAL_AT, rank 0 sends SIGTERM to its launcher (torchrun), which
  forwards it to every worker: a cluster's preemption in the middle of an iteration.
- Crash: on the first start only (TORCHELASTIC_RESTART_COUNT=0), rank 1 exits at iteration MMRL_TEST_CRASH_AT's
  call: a worker that dies, for torchrun --max-restarts to bring back.
"""

import os
import signal
import sys
import time


class _Brightness:
    def __init__(self):
        self.calls = 0

    def score(self, outputs):
        self.calls += 1
        return {"overall": -(outputs.float().mean(dim=(1, 2, 3)) - 0.2).abs()}


class Late(_Brightness):
    def __init__(self):
        super().__init__()
        if os.environ.get("RANK") == "1":
            time.sleep(float(os.environ.get("MMRL_TEST_LATE_S", "25")))

    def __call__(self, outputs, examples):
        return self.score(outputs)


class Preempt(_Brightness):
    def __call__(self, outputs, examples):
        if self.calls == int(os.environ["MMRL_TEST_SIGNAL_AT"]) and os.environ.get("RANK") == "0":
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(1.0)  # the signal arrives while this iteration is still running
        return self.score(outputs)


class Crash(_Brightness):
    def __call__(self, outputs, examples):
        if (self.calls == int(os.environ["MMRL_TEST_CRASH_AT"]) and os.environ.get("RANK") == "1"
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print("a worker dies (test)", file=sys.stderr, flush=True)
            os._exit(17)  # the process dies (an exception would be a failed reward, counted and skipped)
        return self.score(outputs)
