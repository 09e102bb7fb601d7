"""TRL and accelerate with a converted model, on 2 CPU ranks.

* ``trl.SFTTrainer`` (TRL's defaults: gradient checkpointing on), ``args.deepspeed`` = an FSSDP
  config (ZeRO 2, SGD, clipping): a converted Qwen3-MoE trained in full, and with a LoRA
  ``peft_config`` on its experts and attention (TRL applies PEFT to the converted model), gives
  every micro-step's loss of the same SFT run of the unconverted model under plain DeepSpeed
  ZeRO 2; the LoRA run's factors equal too. The same LoRA run on a model loaded by
  ``integrations.hf.from_pretrained`` (each rank holding only its own experts, which PEFT must
  freeze) gives the same losses and factors, and ``trainer.save_model`` writes the adapters as
  PEFT saves them (the plain run's, loaded with ``PeftModel.from_pretrained``).
* ``accelerate launch --use_deepspeed --deepspeed_config_file ...`` runs a converted model's
  training script (``tests/accelerate_train.py``) through FSSDP: its losses equal single-process
  training of the unconverted model (SGD, clipping).
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from distributed import free_port, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_hf_families_training import CLIP, STEPS, WORLD, reference  # noqa: E402
from test_hf_trainer import SGD_CONFIG, Data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
Z2_CONFIG = dict(SGD_CONFIG, zero_optimization={"stage": 2})


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (ids 0-2 are pad, eos, bos), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hf_tiny import VOCAB
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>")


def sft_run(model, out_dir, *, peft_config=None):
    import datasets
    from trl import SFTConfig, SFTTrainer

    class RecordingSFTTrainer(SFTTrainer):

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(float(loss[0].detach() if isinstance(loss, tuple) else loss.detach()))
            return loss

    data = datasets.Dataset.from_dict({"input_ids": [Data()[i]["input_ids"].tolist() for i in range(32)]})
    args = SFTConfig(output_dir=out_dir, use_cpu=True, deepspeed=copy.deepcopy(Z2_CONFIG), per_device_train_batch_size=2,
                     max_steps=3, learning_rate=0.3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.5,
                     report_to=[], logging_steps=1, disable_tqdm=True, seed=0, save_strategy="no",
                     dataloader_num_workers=0, bf16=False)  # TRL defaults to bf16; fp32 compares tightly
    trainer = RecordingSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer(),
                                  peft_config=peft_config)
    trainer.losses = []
    trainer.train()
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return trainer, lora


def sft_worker(rank, world, out_dir):
    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.engine import FSSDPEngineMixin
    from hf_tiny import tiny_model
    from lora_tiny import lora_config
    out = {}
    for name, peft_config in (("full", None), ("lora", lora_config(rank_pattern={}))):
        fssdp_hf.restore_deepspeed_initialize()
        plain, plain_lora = sft_run(tiny_model("qwen3_moe"), os.path.join(out_dir, f"plain_{name}"),
                                    peft_config=copy.deepcopy(peft_config))
        model = fssdp_hf.convert(tiny_model("qwen3_moe"))
        trainer, lora = sft_run(model, os.path.join(out_dir, f"fssdp_{name}"), peft_config=copy.deepcopy(peft_config))
        out[name] = dict(engine=isinstance(trainer.model_wrapped, FSSDPEngineMixin), losses=trainer.losses,
                         plain_losses=plain.losses, lora=lora, plain_lora=plain_lora,
                         wrappers={type(m).__name__ for n, m in trainer.model.named_modules() if n.endswith("mlp.experts")})
        fssdp_hf.restore_deepspeed_initialize()
    # LoRA on a model from integrations.hf.from_pretrained: this rank reads only its own experts.
    path = os.path.join(out_dir, "ckpt")
    if rank == 0:
        tiny_model("qwen3_moe").save_pretrained(path)
    torch.distributed.barrier()  # the Trainer runs above started the process group
    model = fssdp_hf.from_pretrained(path, ds_config=copy.deepcopy(Z2_CONFIG), dtype=torch.float32)
    owned = [m.owned.owned_E.tolist() for _, m in fssdp_hf.converted_experts(model)]
    trainer, lora = sft_run(model, os.path.join(out_dir, "loaded_lora"), peft_config=lora_config(rank_pattern={}))
    saved = os.path.join(out_dir, "loaded_adapters")
    trainer.save_model(saved)
    wrappers = {type(m).__name__ for n, m in trainer.model.named_modules() if n.endswith("mlp.experts")}
    out["loaded"] = dict(owned=owned, engine=isinstance(trainer.model_wrapped, FSSDPEngineMixin),
                         losses=trainer.losses, plain_losses=out["lora"]["plain_losses"], lora=lora,
                         plain_lora=out["lora"]["plain_lora"], saved=saved, wrappers=wrappers)
    fssdp_hf.restore_deepspeed_initialize()
    return out


@pytest.mark.parametrize("name", ["full", "lora", "loaded"])
def test_sft_trainer_matches_plain_deepspeed_zero2(sft, name):
    for rank, res in enumerate(sft):
        run = res[name]
        assert run["engine"] and len(run["losses"]) == len(run["plain_losses"]) == 3
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["plain_losses"]), rtol=1e-5,
                                   atol=1e-6)
        assert set(run["lora"]) == set(run["plain_lora"]) and (name != "full") == bool(run["lora"])
        for key, value in run["plain_lora"].items():
            torch.testing.assert_close(run["lora"][key], value, rtol=1e-4, atol=1e-6, msg=key)
        if name != "full":
            assert run["wrappers"] == {"FSSDPParamWrapper"}
        if name == "loaded":
            assert run["owned"] == [[0, 1], [0, 1]] if rank == 0 else run["owned"] == [[2, 3], [2, 3]]
    if name == "loaded":  # PEFT's own files, holding the trained factors under PEFT's saved names
        from safetensors.torch import load_file
        saved = sft[0]["loaded"]["saved"]
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(saved))
        adapters = load_file(os.path.join(saved, "adapter_model.safetensors"))
        trained = {k.replace(".default.", "."): v for k, v in sft[0]["loaded"]["lora"].items()}
        assert set(adapters) == set(trained)
        for key, value in trained.items():
            torch.testing.assert_close(adapters[key], value, rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    return spawn(WORLD, sft_worker, str(tmp_path_factory.mktemp("sft")))


def test_accelerate_launch_runs_a_converted_model(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "fssdp": {"materialization_budget": 2, "overlap_degree": 4, "load_window": 1}}
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--deepspeed_config_file",
           str(cfg_path), "--num_processes", str(WORLD), "--num_machines", "1", "--main_process_port",
           str(free_port()), os.path.join(HERE, "accelerate_train.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref_losses, _, _ = reference("qwen3_moe")
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["world"] == WORLD and res["engine"].startswith("FSSDP"), res
        assert res["distributed_type"] == "DistributedType.DEEPSPEED"
        want = [ref_losses[(s, rank)] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want), rtol=2e-5, atol=2e-6)
