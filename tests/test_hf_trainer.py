"""The HF Trainer path: a converted tiny model trains with FSSDP on 2 gloo CPU ranks and matches the
unconverted model trained by plain DeepSpeed through the same Trainer.

One spawn runs, on every rank: (1) the unconverted Qwen2-MoE (shared expert, unnormalised top-k)
under plain DeepSpeed with SGD + momentum, ZeRO 1, gradient accumulation 2 and clipping;
(2) the same model converted, through FSSDP, same config: per-micro-step losses and the final
weights match tightly (fp32 summation order); then ``unconvert`` + ``trainer.save_model`` +
``from_pretrained`` reproduce the trained model's logits; (3) a converted Mixtral with
``ds_configs/hf_fssdp.json`` itself (AdamW, the file a user passes) against plain DeepSpeed with
the same file: the first step's loss is the same; the next ones within the Adam tolerance of
``environment.md`` (a correct data-parallel run drifts by ~1e-3 relative at most); (4) the
converted Qwen2-MoE under ZeRO 3 (dense parameters partitioned, the HF router gathered by ZeRO 3,
experts under FSSDP) against plain DeepSpeed ZeRO 3, SGD with clipping: every loss, tight; (5) the
same with ZeRO-3 ``TrainingArguments`` made first and the model from ``integrations.hf.from_pretrained``
(the dense part partitioned while it loads). ``trainer.save_model`` on the converted model (before
``unconvert``) writes, through ``integrations.hf.save_pretrained``, a directory that reloads to the
trained weights bitwise; so does ``trainer.save_model()`` into ``output_dir`` beside the run's
``checkpoint-3``, twice.
"""
import copy
import json
import os

import pytest
import torch

from distributed import spawn

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_CONFIG = os.path.join(REPO, "ds_configs", "hf_fssdp.json")
WORLD = 2
MICRO = 2  # sequences per rank per micro-step
SEQ = 12

SGD_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9, "weight_decay": "auto"}},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
    "fssdp": {"policy": "fssdp", "materialization_budget": 2, "overlap_degree": 4, "load_window": 2},
}


class Data(torch.utils.data.Dataset):
    """Skewed token ids (so routing is skewed), one fixed sequence per index."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(1000 + i)
        probs = torch.arange(61, 0, -1, dtype=torch.float).pow(2)
        ids = 3 + torch.multinomial(probs, SEQ, replacement=True, generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make_trainer(model, ds_config, out_dir, *, steps, gas, lr, max_grad_norm, **training_args):
    class RecordingTrainer(transformers.Trainer):

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(float(loss[0].detach() if isinstance(loss, tuple) else loss.detach()))
            return loss

    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, deepspeed=copy.deepcopy(ds_config), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=gas, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=max_grad_norm, report_to=[], logging_steps=1, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **{"save_strategy": "no", **training_args})
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Data())
    trainer.losses = []
    return trainer


def trainer_worker(rank, world, out_dir):
    import deepspeed
    from deepspeed import comm as dist

    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.engine import FSSDPEngineMixin
    from hf_tiny import tiny_model

    out = {}
    # (1) + (2): tight, SGD.
    sgd = dict(steps=3, gas=2, lr=0.3, max_grad_norm=0.5)
    fssdp_hf.restore_deepspeed_initialize()
    plain_model = tiny_model("qwen2_moe")
    plain = make_trainer(plain_model, SGD_CONFIG, os.path.join(out_dir, "plain"), **sgd)
    plain.train()
    assert not isinstance(plain.model_wrapped, FSSDPEngineMixin)
    out["plain_losses"] = plain.losses
    out["plain_state"] = {k: v.detach().clone() for k, v in plain_model.state_dict().items()}

    model = fssdp_hf.convert(tiny_model("qwen2_moe"))
    assert deepspeed.initialize is fssdp_hf.initialize
    # A Trainer checkpoint at the last step: output_dir then holds checkpoint-3 (its save_model first).
    trainer = make_trainer(model, SGD_CONFIG, os.path.join(out_dir, "fssdp"), save_strategy="steps", save_steps=3,
                           **sgd)
    trainer.train()
    engine = trainer.model_wrapped
    out["fssdp_engine"] = isinstance(engine, FSSDPEngineMixin)
    out["sharded"] = [m.sharded is not None for _, m in fssdp_hf.converted_experts(model)]
    out["owned"] = [int(m.sharded.owned_E.numel()) for _, m in fssdp_hf.converted_experts(model)]
    out["dense_params_have_experts"] = any(".experts." in n for n, _ in engine.module.named_parameters())
    out["fssdp_losses"] = trainer.losses
    out["fssdp_state"] = fssdp_hf.hf_state_dict(model)  # collective
    # trainer.save_model on the converted model: integrations.hf.save_pretrained on every rank.
    direct = os.path.join(out_dir, "saved_direct")
    trainer.save_model(direct)
    dist.barrier()
    out["direct_state"] = transformers.AutoModelForCausalLM.from_pretrained(direct).state_dict()
    out["direct_files"] = sorted(os.listdir(direct))
    # trainer.save_model() into output_dir beside checkpoint-3, twice (the second overwrites, as HF's does).
    trainer.save_model()
    trainer.save_model()
    dist.barrier()
    out["output_dir_files"] = sorted(os.listdir(trainer.args.output_dir))
    out["output_dir_state"] = transformers.AutoModelForCausalLM.from_pretrained(trainer.args.output_dir).state_dict()
    fssdp_hf.unconvert(model)  # collective
    saved = os.path.join(out_dir, "saved")
    trainer.save_model(saved)
    dist.barrier()
    probe = Data()[0]["input_ids"].unsqueeze(0)
    model.eval()
    with torch.no_grad():
        out["trained_logits"] = model(input_ids=probe).logits
        out["reloaded_logits"] = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()(
            input_ids=probe).logits

    # (3): the shipped config file (AdamW), a converted Mixtral against plain DeepSpeed.
    adam = dict(steps=3, gas=1, lr=1e-3, max_grad_norm=1.0)
    with open(HF_CONFIG) as f:
        file_config = json.load(f)
    fssdp_hf.restore_deepspeed_initialize()
    plain = make_trainer(tiny_model("mixtral"), file_config, os.path.join(out_dir, "plain_adam"), **adam)
    plain.train()
    out["plain_adam_losses"] = plain.losses
    model = fssdp_hf.convert(tiny_model("mixtral"))
    trainer = make_trainer(model, HF_CONFIG, os.path.join(out_dir, "fssdp_adam"), **adam)  # the path itself
    trainer.train()
    out["fssdp_adam_engine"] = isinstance(trainer.model_wrapped, FSSDPEngineMixin)
    out["fssdp_adam_losses"] = trainer.losses

    # (4): ZeRO 3. The converted model is built before any ZeRO-3 TrainingArguments exist (HF
    # builds models under deepspeed.zero.Init once they do, and FSSDP needs whole experts).
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    z3 = dict(SGD_CONFIG, zero_optimization={"stage": 3})
    model = fssdp_hf.convert(tiny_model("qwen2_moe"))
    trainer = make_trainer(model, z3, os.path.join(out_dir, "fssdp_z3"), **sgd)
    trainer.train()
    out["fssdp_z3_engine"] = isinstance(trainer.model_wrapped, FSSDPEngineMixin)
    out["fssdp_z3_losses"] = trainer.losses
    fssdp_hf.restore_deepspeed_initialize()
    unset_hf_deepspeed_config()  # the same whole-parameter start for the plain model
    plain = make_trainer(tiny_model("qwen2_moe"), z3, os.path.join(out_dir, "plain_z3"), **sgd)
    plain.train()
    out["plain_z3_losses"] = plain.losses
    unset_hf_deepspeed_config()

    # (5): ZeRO 3 TrainingArguments first, then integrations.hf.from_pretrained: the dense part is
    # partitioned while it loads, each rank reads its own experts (the model (4) started from).
    start = os.path.join(out_dir, "qwen2_moe_start")
    if rank == 0:
        tiny_model("qwen2_moe").save_pretrained(start)
    dist.barrier()
    args = make_trainer(tiny_model("qwen2_moe"), z3, os.path.join(out_dir, "args_z3"), **sgd).args
    model = fssdp_hf.from_pretrained(start, ds_config=z3, dtype=torch.float32)
    out["loaded_z3_partitioned"] = sum(hasattr(p, "ds_id") for p in model.parameters())
    trainer = make_trainer(model, z3, os.path.join(out_dir, "loaded_z3"), **sgd)
    assert trainer.args.hf_deepspeed_config is not None and args is not None
    trainer.train()
    out["loaded_z3_losses"] = trainer.losses
    unset_hf_deepspeed_config()
    return out


def test_hf_trainer_fssdp_matches_plain_deepspeed(tmp_path):
    results = spawn(WORLD, trainer_worker, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["fssdp_engine"] and r["fssdp_adam_engine"], rank
        assert r["sharded"] == [True, True] and r["owned"] == [2, 2], r["owned"]
        assert not r["dense_params_have_experts"]
        # SGD: every micro-step's loss and the final weights, tight (fp32 summation order).
        assert len(r["fssdp_losses"]) == len(r["plain_losses"]) == 6
        torch.testing.assert_close(torch.tensor(r["fssdp_losses"]), torch.tensor(r["plain_losses"]), rtol=1e-5,
                                   atol=1e-6)
        assert r["plain_losses"][-1] < r["plain_losses"][0] - 0.05, "training did not move the loss"
        assert set(r["fssdp_state"]) == set(r["plain_state"])
        for key, value in r["plain_state"].items():
            torch.testing.assert_close(r["fssdp_state"][key], value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(r["reloaded_logits"], r["trained_logits"], rtol=1e-5, atol=1e-5)
        assert "model.safetensors.index.json" in r["direct_files"] and "training_args.bin" in r["direct_files"]
        assert {"checkpoint-3", "model.safetensors.index.json"} <= set(r["output_dir_files"])
        assert all(torch.equal(r["output_dir_state"][k], v) for k, v in r["direct_state"].items())
        for key, value in r["fssdp_state"].items():
            assert torch.equal(r["direct_state"][key], value), key
        # AdamW from the shipped file: step 1 is before any update (same weights, same data).
        plain, fssdp = r["plain_adam_losses"], r["fssdp_adam_losses"]
        assert len(plain) == len(fssdp) == 3
        assert abs(fssdp[0] - plain[0]) <= 1e-5 * abs(plain[0])
        for a, b in zip(fssdp[1:], plain[1:]):
            assert abs(a - b) <= 1e-3 * abs(b), (fssdp, plain)
        # ZeRO 3, SGD: every micro-step's loss, tight.
        assert r["fssdp_z3_engine"] and len(r["fssdp_z3_losses"]) == len(r["plain_z3_losses"]) == 6
        torch.testing.assert_close(torch.tensor(r["fssdp_z3_losses"]), torch.tensor(r["plain_z3_losses"]),
                                   rtol=1e-5, atol=1e-6)
        # (5) from_pretrained after ZeRO-3 TrainingArguments: partitioned at load, the same losses.
        assert r["loaded_z3_partitioned"] > 0
        torch.testing.assert_close(torch.tensor(r["loaded_z3_losses"]), torch.tensor(r["plain_z3_losses"]),
                                   rtol=1e-5, atol=1e-6)
    # Both ranks end with the same weights (the experts gathered from their owners).
    for key, value in results[0]["fssdp_state"].items():
        assert torch.equal(results[1]["fssdp_state"][key], value), key
