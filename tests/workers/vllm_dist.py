"""Worker for tests/test_vllm_engine.py: a token policy whose rollouts come from vLLM, trained under torchrun with DDP
(each rank its own engine through vLLM's external launcher), 2 iterations; rank 0 writes OUT (json): the last
iteration's metrics, how many weight syncs each rank's engine made, and whether the ranks stayed in sync.

    torchrun --standalone --nproc_per_node 2 tests/workers/vllm_dist.py MODEL OUT [key=value ...]
"""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    model, out, *over = sys.argv[1:]
    torch.set_num_threads(1)
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    cfg = load_config(None, ["model.policy=token", f"model.path={model}", "model.reference=none",
                             "sampler.engine=vllm", "sampler.max_new_tokens=12", "sampler.temperature=1.0",
                             'sampler.vllm={"max_model_len": 256}', "task.name=arithmetic", "reward.name=arithmetic",
                             "train.parallel=ddp", "train.prompts_per_iter=2", "train.group_size=4",
                             "train.minibatches=2", f"log.out_dir={out}.run", "log.tensorboard=false",
                             "log.progress=false", *over])
    tr = Trainer(cfg)
    for it in range(2):
        tr.iteration = it
        m = tr.step(it)
    tr.dist.check_in_sync(tr.params)  # raises when the ranks' weights differ
    syncs = tr.dist.gather_list([tr.policy.engine.syncs], every_rank=True)
    if tr.dist.main:
        with open(out, "w") as f:
            json.dump({"metrics": m, "syncs": syncs, "world": tr.dist.world}, f)
    tr.dist.close()


if __name__ == "__main__":
    main()
