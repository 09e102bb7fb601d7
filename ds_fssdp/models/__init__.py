from ds_fssdp.models.gpt_moe import GPTMoE, GPTMoEConfig

__all__ = ["GPTMoE", "GPTMoEConfig"]
