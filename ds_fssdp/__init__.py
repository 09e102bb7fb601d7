"""ds-fssdp: Fully Sharded Sparse Data Parallelism for MoE training, as a DeepSpeed extension.

    from ds_fssdp import FSSDPMoE, initialize
    engine, optimizer, _, _ = ds_fssdp.initialize(model=model, config="ds_config.json")
"""
from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.integrations.deepspeed_moe import MoE  # drop-in for deepspeed.moe.layer.MoE
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.moe.layer import FSSDPMoE
from ds_fssdp.runtime.elastic import destroy_process_group, init_distributed
from ds_fssdp.runtime.engine import initialize
from ds_fssdp.runtime.preempt import Preemption
from ds_fssdp.runtime.resume import resume, save_step
from ds_fssdp.topology import Topology

__version__ = "0.1.0"
__all__ = ["FSSDPConfig", "FSSDPConfigError", "FSSDPExperts", "FSSDPMoE", "MoE", "Preemption", "Topology", "__version__",
           "destroy_process_group", "init_distributed", "initialize", "resume", "save_step"]
