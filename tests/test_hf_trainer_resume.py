"""HF Trainer checkpoints with FSSDP: a run that saves at step 2 and is resumed from that
checkpoint by a new Trainer continues exactly as the uninterrupted run (losses and weights), on 2
gloo CPU ranks. The Trainer saves through ``engine.save_checkpoint`` (experts keyed by (layer,
expert)) and resumes through ``engine.load_checkpoint``. The model is DeepSeek-V3-style with the
router bias update on, so the trained ``e_score_correction_bias`` must come back too.
"""
import copy
import os

import pytest
import torch

from distributed import spawn
from test_hf_trainer import SGD_CONFIG, make_trainer

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

transformers = pytest.importorskip("transformers")

WORLD = 2
MODEL = "deepseek_v3"
CONFIG = copy.deepcopy(SGD_CONFIG)
CONFIG["fssdp"]["router_bias_update_rate"] = 0.05


def resume_worker(rank, world, out_dir):
    from deepspeed import comm as dist

    import ds_fssdp.integrations.hf as fssdp_hf
    from hf_tiny import tiny_model

    sgd = dict(gas=1, lr=0.3, max_grad_norm=0.5)
    out = {}
    # Uninterrupted: 4 steps.
    model = fssdp_hf.convert(tiny_model(MODEL))
    full = make_trainer(model, CONFIG, os.path.join(out_dir, "full"), steps=4, **sgd)
    full.train()
    out["full_losses"] = full.losses
    out["full_state"] = fssdp_hf.hf_state_dict(model)  # collective

    # Interrupted: 4 steps planned, a checkpoint every 2; the process "dies" after step 2 ...
    run_dir = os.path.join(out_dir, "run")
    model = fssdp_hf.convert(tiny_model(MODEL))
    first = make_trainer(model, CONFIG, run_dir, steps=4, save_strategy="steps", save_steps=2, **sgd)

    class Stop(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    first.add_callback(Stop())
    first.train()
    out["first_losses"] = first.losses
    dist.barrier()
    ckpt = os.path.join(run_dir, "checkpoint-2")
    out["checkpoint_files"] = sorted(os.listdir(ckpt))
    tag_dir = os.path.join(ckpt, "global_step2")
    out["expert_files"] = sorted(os.listdir(os.path.join(tag_dir, "fssdp"))) if os.path.isdir(tag_dir) else []
    out["manifest"] = os.path.isfile(os.path.join(tag_dir, "manifest.json"))
    # ... and a new Trainer on a freshly built model resumes from the checkpoint.
    model = fssdp_hf.convert(tiny_model(MODEL, seed=123))  # other weights: the checkpoint must bring them
    second = make_trainer(model, CONFIG, run_dir, steps=4, **sgd)
    second.train(resume_from_checkpoint=ckpt)
    out["second_losses"] = second.losses
    out["resumed_state"] = fssdp_hf.hf_state_dict(model)
    fssdp_hf.restore_deepspeed_initialize()
    return out


def test_hf_trainer_resumes_an_fssdp_checkpoint_exactly(tmp_path):
    results = spawn(WORLD, resume_worker, str(tmp_path))
    for rank, r in enumerate(results):
        assert len(r["full_losses"]) == 4 and len(r["first_losses"]) == 2 and len(r["second_losses"]) == 2, r
        # The Trainer's checkpoint holds FSSDP's expert state (keyed by layer and expert) and its manifest.
        assert r["manifest"] and r["expert_files"], (r["checkpoint_files"], r["expert_files"])
        assert r["first_losses"] == r["full_losses"][:2], rank
        assert r["second_losses"] == r["full_losses"][2:], (rank, r["second_losses"], r["full_losses"])
        biases = [k for k in r["full_state"] if k.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all(bool(r["full_state"][k].abs().sum() > 0) for k in biases)
        for key, value in r["full_state"].items():
            assert torch.equal(r["resumed_state"][key], value), key
