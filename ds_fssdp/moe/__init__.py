from ds_fssdp.moe.gate import GateOutput, TopKGate
from ds_fssdp.moe.layer import FSSDPMoE
from ds_fssdp.moe.sharded import ShardedExperts

__all__ = ["GateOutput", "TopKGate", "FSSDPMoE", "ShardedExperts"]
