from ds_fssdp.runtime.engine import FSSDPEngineMixin, initialize
from ds_fssdp.runtime.stage import FSSDPStage

__all__ = ["FSSDPEngineMixin", "initialize", "FSSDPStage"]
