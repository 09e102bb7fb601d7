"""Starting the process group so that torchelastic's restarts work (``torchrun --max-restarts``).

torchrun keeps one rendezvous TCP store for all attempts of a job and hands it to the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``); torch's env:// rendezvous uses it without a per-attempt
prefix, so a restarted worker group reads the addresses the dead attempt left in the store, and
gloo fails with ``connectFullMesh failed ... Connection refused`` (pytorch/pytorch#135712). Here
the default process group is created on a ``PrefixStore`` keyed by the attempt
(``TORCHELASTIC_RESTART_COUNT``) before DeepSpeed's comm starts, which then adopts it; every
group created later shares that prefix. Outside torchelastic this is ``deepspeed.init_distributed``.
On CPU, DeepSpeed's shared-memory comm op (inference all-reduce only) is not JIT-built first.
"""
from __future__ import annotations

import os
from datetime import timedelta

import deepspeed
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT, default_pg_timeout
from deepspeed.utils import logger

from ds_fssdp.runtime.cpu import skip_shm_comm_build


def init_distributed(*, backend: str | None = None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
                     dist_init_required=None, timeout: timedelta = default_pg_timeout) -> None:
    """``deepspeed.init_distributed``, restart-safe under torchelastic. Idempotent."""
    backend = backend or get_accelerator().communication_backend_name()
    if not tdist.is_initialized() and dist_init_required is not False and _agent_store_shared():
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                               is_master=False, timeout=timeout)
        tdist.init_process_group(backend, store=tdist.PrefixStore(f"ds_fssdp/attempt_{attempt}/", store), rank=rank,
                                 world_size=world, timeout=timeout)
        if rank == 0:
            logger.info(f"fssdp: process group of torchelastic attempt {attempt} on its own store prefix")
    if get_accelerator().device_name() == "cpu":
        skip_shm_comm_build()  # before DeepSpeed's comm starts: training never uses that op
    deepspeed.init_distributed(dist_backend=backend, distributed_port=distributed_port,
                               dist_init_required=dist_init_required, timeout=timeout)


def destroy_process_group() -> None:
    """Tear the default process group down (a process that exits without it can abort in a gloo
    thread's destructor: ``terminate called without an active exception``). Idempotent."""
    if tdist.is_initialized():
        tdist.destroy_process_group()


def _agent_store_shared() -> bool:
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in os.environ
            and all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")))
