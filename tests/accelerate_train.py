"""A converted model's training script for ``accelerate launch --use_deepspeed
--deepspeed_config_file CFG`` (tests/test_trl_accelerate.py launches it): a tiny Qwen3-MoE,
``convert``, ``accelerator.prepare`` with a client SGD, 3 steps on this rank's batches; every
rank writes its losses and engine class to OUT_DIR/rankN.json.

    accelerate launch --use_deepspeed --deepspeed_config_file cfg.json --num_processes 2 \\
        tests/accelerate_train.py OUT_DIR
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(out_dir: str) -> None:
    from accelerate import Accelerator

    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.cpu import skip_shm_comm_build
    from hf_tiny import tiny_model
    from test_hf_families_training import LR, MOMENTUM, STEPS, _data

    skip_shm_comm_build()
    model = fssdp_hf.convert(tiny_model("qwen3_moe"))  # the one line; routes deepspeed.initialize
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    # On CPU accelerate 1.15 reports process_index 0 and num_processes 1 on every rank under
    # --use_deepspeed, while DeepSpeed's (and so FSSDP's) process group spans both: ask torch.
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(STEPS):
        loss = model(**_data(step, rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"engine": type(model).__name__, "losses": losses, "world": torch.distributed.get_world_size(),
                   "distributed_type": str(accelerator.distributed_type)}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
