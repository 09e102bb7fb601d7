from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.moe.gate import GateOutput, TopKGate
from ds_fssdp.moe.layer import FSSDPMoE
from ds_fssdp.moe.sharded import ShardedExperts

__all__ = ["GateOutput", "TopKGate", "FSSDPExperts", "FSSDPMoE", "ShardedExperts"]
