"""Adapters that put existing models on FSSDP: Hugging Face ``transformers`` MoE models (``hf``: convert,
load, save, the Trainer; PEFT LoRA on experts) and ``deepspeed_moe.MoE``, a drop-in for
``deepspeed.moe.layer.MoE`` (exported as ``ds_fssdp.MoE``). Submodules are imported on use:
``transformers`` is only needed by the HF ones.
"""
