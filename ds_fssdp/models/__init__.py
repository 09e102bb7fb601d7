from ds_fssdp.models.gpt_moe import GPTMoE, GPTMoEConfig
from ds_fssdp.models.gpt_moe_pipe import GPTMoEPipe

__all__ = ["GPTMoE", "GPTMoEConfig", "GPTMoEPipe"]
