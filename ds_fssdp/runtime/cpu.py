"""CPU-only conveniences for DeepSpeed."""
from __future__ import annotations

import sys

from deepspeed.utils import logger


def skip_shm_comm_build() -> None:
    """Skip DeepSpeed's shared-memory comm op JIT build on CPU (about a minute on first use).

    DeepSpeed builds it when the comm backend starts, and uses it only for inference all-reduce;
    training never calls it. ``ds_fssdp.initialize`` calls this on CPU before it starts DeepSpeed's
    comm; a script that starts the comm itself first (``deepspeed.init_distributed``) calls it
    before that."""
    import deepspeed.comm.torch  # noqa: F401  (the attribute of that name is the torch module)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    logger.info("ds_fssdp: skipping DeepSpeed's shared-memory inference comm op build (CPU training)")
