"""PEFT LoRA on FSSDP experts trains exactly: 2 gloo ranks (2 logical nodes), 3 SGD steps.

One spawn runs, on every rank:

* through ``ds_fssdp.initialize``: Qwen3-MoE (PEFT applied after ``convert``) and DeepSeek-V3
  (``convert`` given the PEFT model), LoRA on both expert tensors (``rank_pattern`` gives one
  layer's ``down_proj`` rank 3) and on the attention output, ZeRO 1, SGD + momentum, clipping:
  losses and every LoRA factor equal single-process PEFT training of the unconverted model (each
  rank's batch, averaged, one global-norm clip); the base experts are bit-identical afterwards;
  replicas were gathered (the factors ran on replica rows too);
* through the HF Trainer: both families against the same PEFT model trained by plain DeepSpeed
  through the same Trainer (every loss, every factor); then ``unconvert`` + ``save_model`` writes
  the adapter, which loads into a plain HF + PEFT model with the same logits, and
  ``merge_and_unload`` gives the same logits;
* refusals at ``ds_fssdp.initialize``, before any collective: ZeRO 3 and ``fssdp.rematerialize``.
"""
import os

import pytest
import torch

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from hf_tiny import batch, tiny_model  # noqa: E402
from lora_tiny import lora_model, lora_state  # noqa: E402
from test_hf_families_training import STEPS, WORLD, ds_config, train_steps  # noqa: E402
from test_hf_families_training import reference as families_reference  # noqa: E402
from test_hf_trainer import SGD_CONFIG, Data, make_trainer  # noqa: E402

RUNS = (("qwen3_moe", "after"), ("deepseek_v3", "before"))
TOL = dict(rtol=2e-5, atol=2e-6)


def _base_experts(state: dict) -> dict:
    return {k: v for k, v in state.items() if ".experts." in k and "lora_" not in k}


def _refusal(model_type, **changes):
    import ds_fssdp
    cfg = ds_config()
    for key, value in changes.items():
        section, _, field = key.partition(".")
        cfg[section] = dict(cfg[section], **{field: value})
    model = lora_model(model_type, order="before")
    try:
        ds_fssdp.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad])
    except ValueError as err:
        return str(err)
    return None


def _worker(rank, world, out_dir):
    from deepspeed import comm as dist

    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.engine import FSSDPEngineMixin
    out = {}
    for mt, order in RUNS:
        model = lora_model(mt, order=order)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = ds_fssdp.initialize(model=model, config=ds_config(), model_parameters=params)
        losses, _, replicas = train_steps(engine, model, rank)
        state = fssdp_hf.hf_state_dict(model)  # collective
        out[mt] = dict(losses=losses, replicas=replicas, lora={k: v for k, v in state.items() if "lora_" in k},
                       base=_base_experts(state),
                       wrappers={type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})

    # The Trainer, both families, against plain DeepSpeed through the same Trainer.
    sgd = dict(steps=3, gas=1, lr=0.3, max_grad_norm=0.5)
    probe = Data()[0]["input_ids"].unsqueeze(0)
    for mt, order in RUNS:
        fssdp_hf.restore_deepspeed_initialize()
        plain_model = lora_model(mt)
        plain = make_trainer(plain_model, SGD_CONFIG, os.path.join(out_dir, f"plain_{mt}"), **sgd)
        plain.train()
        model = lora_model(mt, order=order, route_initialize=True)
        trainer = make_trainer(model, SGD_CONFIG, os.path.join(out_dir, f"fssdp_{mt}"), **sgd)
        trainer.train()
        run = dict(engine=isinstance(trainer.model_wrapped, FSSDPEngineMixin), losses=trainer.losses,
                   plain_losses=plain.losses, lora=lora_state(model), plain_lora=lora_state(plain_model))
        fssdp_hf.unconvert(model)  # collective
        saved = os.path.join(out_dir, f"adapter_{mt}")
        trainer.save_model(saved)
        dist.barrier()
        model.eval()
        with torch.no_grad():
            run["trained_logits"] = model(input_ids=probe).logits
            from peft import PeftModel
            reloaded = PeftModel.from_pretrained(tiny_model(mt), saved).eval()
            run["reloaded_logits"] = reloaded(input_ids=probe).logits
            run["merged_logits"] = model.merge_and_unload()(input_ids=probe).logits
        run["saved_files"] = sorted(os.listdir(saved))
        out[("trainer", mt)] = run
    fssdp_hf.restore_deepspeed_initialize()

    out["refuse_zero3"] = _refusal("qwen3_moe", **{"zero_optimization.stage": 3})
    out["refuse_remat"] = _refusal("qwen3_moe", **{"fssdp.rematerialize": True})
    return out


def reference(model_type):
    """Single process, plain HF + PEFT (same factors), every rank's batch, DeepSpeed's math by hand."""
    losses, state, _ = families_reference(model_type, model=lora_model(model_type))
    return losses, {k: v for k, v in state.items() if "lora_" in k}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return spawn(WORLD, _worker, str(tmp_path_factory.mktemp("lora")))


@pytest.mark.parametrize("model_type", [mt for mt, _ in RUNS])
def test_lora_on_experts_trains_like_single_process_peft(trained, model_type):
    ref_losses, ref_lora = reference(model_type)
    initial = _base_experts(tiny_model(model_type).state_dict())
    initial_lora = lora_model(model_type).state_dict()
    for rank, res in enumerate(trained):
        run = res[model_type]
        assert run["wrappers"] == {"FSSDPParamWrapper"}
        assert run["replicas"] > 0
        want = [ref_losses[(s, rank)] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL)
        assert set(run["lora"]) == set(ref_lora) and any("experts.base_layer.lora_A.default" in k for k in ref_lora)
        for key, value in ref_lora.items():
            torch.testing.assert_close(run["lora"][key], value, rtol=1e-4, atol=1e-6, msg=key)
            assert not torch.equal(value, initial_lora[key]), key  # it trained
        base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in run["base"].items()}
        assert set(base) == set(initial)
        for key, value in initial.items():
            assert torch.equal(base[key], value), key


@pytest.mark.parametrize("model_type", [mt for mt, _ in RUNS])
def test_lora_through_the_trainer_and_adapter_round_trip(trained, model_type):
    for res in trained:
        run = res[("trainer", model_type)]
        assert run["engine"] and len(run["losses"]) == len(run["plain_losses"]) == 3
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["plain_losses"]), rtol=1e-5,
                                   atol=1e-6)
        for key, value in run["plain_lora"].items():
            torch.testing.assert_close(run["lora"][key], value, rtol=1e-4, atol=1e-6, msg=key)
        assert "adapter_model.safetensors" in run["saved_files"]
        torch.testing.assert_close(run["reloaded_logits"], run["trained_logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run["merged_logits"], run["trained_logits"], rtol=1e-5, atol=1e-5)


def test_lora_refusals_name_the_key(trained):
    for res in trained:
        assert "zero_optimization.stage (3)" in res["refuse_zero3"]
        assert "fssdp.rematerialize" in res["refuse_remat"]
