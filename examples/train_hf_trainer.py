"""Train a Hugging Face MoE model with the HF Trainer on FSSDP (a tiny one built from a config).

    deepspeed --num_gpus 2 examples/train_hf_trainer.py                  # Mixtral, 2 CPU or GPU ranks
    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --model-type qwen2_moe
    deepspeed --num_gpus 8 examples/train_hf_trainer.py --model Qwen/Qwen3-30B-A3B --out qwen3-ft   # a big one

The FSSDP-specific parts are two: the model, converted (``fssdp_hf.convert(model)``; with ``--model``
``fssdp_hf.from_pretrained``, where each rank reads only the experts it owns), and
``ds_configs/hf_fssdp.json`` (DeepSpeed's keys, "auto" where the Trainer fills them, plus the
``"fssdp"`` section). ``--out DIR``: ``trainer.save_model`` writes a Hugging Face directory, each
rank its own experts (``fssdp_hf.save_pretrained``).

Data: byte-level windows of CPython's standard library (no download). ``--out DIR`` saves the
trained model there.

Checkpoints and restarts (docs/robustness.md): ``--save-dir D --save-interval N [--keep-last K]``
saves ``D/checkpoint-<step>`` every N steps through the Trainer (and the engine's atomic
checkpoint inside); on start the newest complete one is resumed (the Trainer continues the data
stream at the exact next batch). SIGTERM/SIGUSR1 finish the step, save and exit 0.
"""
from __future__ import annotations

import argparse
import os

import torch
import transformers

import ds_fssdp
import ds_fssdp.integrations.hf as fssdp_hf
from ds_fssdp.integrations.hf_resume import PreemptionCallback, last_complete_checkpoint
from ds_fssdp.data import load_corpus
from ds_fssdp.integrations.hf_tiny import TESTED_FAMILIES, tiny_config
from ds_fssdp.runtime import resume_cli
from ds_fssdp.runtime.cpu import skip_shm_comm_build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", default="mixtral", choices=TESTED_FAMILIES)
    p.add_argument("--model", default=None, help="an HF model directory or hub name to fine-tune (instead of a "
                   "tiny --model-type built from its config); bf16 on GPUs")
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF gradient checkpointing (exact under FSSDP)")
    p.add_argument("--deepspeed_config", default=os.path.join(REPO, "ds_configs", "hf_fssdp.json"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default=None, help="save the trained model (HF layout) here")
    resume_cli.add_arguments(p)  # --save-dir, --save-interval, --keep-last, --resume, preemption
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args()  # unknown flags are errors; the deepspeed launcher's --local_rank is declared above
    resume_cli.check_arguments(p, args)
    return args


class ByteWindows(torch.utils.data.Dataset):

    def __init__(self, corpus_N: torch.Tensor, seq_len: int):
        self.corpus_N, self.seq_len = corpus_N, seq_len

    def __len__(self):
        return (self.corpus_N.numel() - 1) // self.seq_len

    def __getitem__(self, i):
        ids = self.corpus_N[i * self.seq_len:(i + 1) * self.seq_len].long()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main():
    args = parse_args()
    use_cpu = not torch.cuda.is_available()
    if use_cpu:
        skip_shm_comm_build()
    ds_fssdp.init_distributed()  # restart-safe under torchrun --max-restarts
    torch.manual_seed(0)
    if args.model:  # each rank reads only the experts it will own (the fssdp section says which)
        model = fssdp_hf.from_pretrained(args.model, ds_config=args.deepspeed_config,
                                         dtype=torch.float32 if use_cpu else torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(
            args.model_type, hidden=64, experts=8, ffn=64, vocab=256, router_aux_loss_coef=0.01))
        model = fssdp_hf.convert(model)  # the one line FSSDP adds
    saving = dict(save_strategy="no")
    if args.save_dir:
        saving = dict(save_strategy="steps", save_steps=args.save_interval or args.steps, save_total_limit=args.keep_last)
    training = transformers.TrainingArguments(
        output_dir=args.save_dir or args.out or "/tmp/fssdp_hf_trainer", use_cpu=use_cpu,
        deepspeed=args.deepspeed_config, per_device_train_batch_size=4, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", logging_steps=5, report_to=[], disable_tqdm=True, seed=0,
        gradient_checkpointing=args.gradient_checkpointing, **saving)
    trainer = transformers.Trainer(model=model, args=training,
                                   train_dataset=ByteWindows(load_corpus(1 << 20), args.seq_len))
    preempt = None
    if not args.no_preempt_handler:
        preempt = PreemptionCallback(ds_fssdp.Preemption(grace_s=args.preempt_grace), save=bool(args.save_dir))
        trainer.add_callback(preempt)
    last = None
    if args.save_dir and args.resume != "none":
        last = last_complete_checkpoint(args.save_dir, which=args.resume)
    result = trainer.train(resume_from_checkpoint=last)
    if preempt is not None and preempt.stopped_at is not None:
        if trainer.is_world_process_zero():
            print(f"preempted: stopped after step {preempt.stopped_at}" +
                  (f", saved in {args.save_dir}" if args.save_dir else " (no --save-dir: nothing saved)"))
        ds_fssdp.destroy_process_group()
        return
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        stats = [m.last_stats for _, m in fssdp_hf.converted_experts(model)]
        print(f"engine {type(engine).__name__}; final train loss {result.training_loss:.3f}; replicas per layer "
              f"{[s['replicas'] for s in stats]}")
    if args.out:  # every rank: each writes its own experts (fssdp_hf.save_pretrained)
        trainer.save_model(args.out)
    ds_fssdp.destroy_process_group()  # an exit without it can abort in gloo's threads


if __name__ == "__main__":
    main()
