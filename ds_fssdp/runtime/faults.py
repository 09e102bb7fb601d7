"""Failure injection for tests: kill, signal or fail one rank at a given step and phase.

Off unless ``FSSDP_FAULTS`` is set (``ds_fssdp.initialize`` installs it then, and costs nothing
otherwise). The variable holds faults separated by ``;``, each ``rank:step:phase[:action[:attempt]]``:

    rank     the global rank that fails
    step     the engine's ``global_steps`` when it fires: the number of optimizer steps completed,
             so step 0 is the first step (the save of ``global_step<N>`` runs at step N)
    phase    forward  the model's forward starts          gate      the first MoE layer's gate ran
             exchange the first MoE layer's token exchange backward  the last MoE layer's backward
             step     the dense optimizer's step          save      a save, DeepSpeed's files written
             convert  inside a Universal Checkpoint conversion (rank 0, on a load at another world size)
    action   kill (SIGKILL, default), term (SIGTERM), usr1 (SIGUSR1), raise (RuntimeError)
    attempt  torchelastic's restart count it fires in (default 0: a restarted job does not repeat it)

    FSSDP_FAULTS="2:7:backward;0:10:save:kill:1"
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

ENV = "FSSDP_FAULTS"
PHASES = ("forward", "gate", "exchange", "backward", "step", "save", "convert")
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "usr1": signal.SIGUSR1, "raise": None}


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    action: str = "kill"
    attempt: int = 0


def parse(text: str) -> list:
    """The faults of an ``FSSDP_FAULTS`` value; a malformed one raises ``ValueError`` naming it."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        fields = item.split(":")
        try:
            if not 3 <= len(fields) <= 5:
                raise ValueError("expected rank:step:phase[:action[:attempt]]")
            fault = Fault(int(fields[0]), int(fields[1]), fields[2], *(fields[3:4] or ["kill"]),
                          *[int(f) for f in fields[4:5]])
            if fault.phase not in PHASES:
                raise ValueError(f"phase must be one of {PHASES}")
            if fault.action not in ACTIONS:
                raise ValueError(f"action must be one of {tuple(ACTIONS)}")
        except ValueError as err:
            raise ValueError(f"{ENV} entry {item!r}: {err}") from None
        faults.append(fault)
    return faults


class Injector:
    """Fires this rank's faults of this attempt; ``point(phase)`` is called at each phase."""

    def __init__(self, faults: list, *, rank: int, attempt: int, engine):
        self.engine = engine
        self.pending = {(f.step, f.phase): f for f in faults if f.rank == rank and f.attempt == attempt}

    def point(self, phase: str) -> None:
        fault = self.pending.pop((int(self.engine.global_steps), phase), None)
        if fault is None:
            return
        # To the file descriptor: the converter runs with sys.stderr redirected.
        os.write(2, f"fssdp faults: rank {fault.rank} {fault.action} at step {fault.step}, phase {phase}\n".encode())
        if fault.action == "raise":
            raise RuntimeError(f"fssdp faults: injected failure at step {fault.step}, phase {phase}")
        os.kill(os.getpid(), ACTIONS[fault.action])


def install_from_env(engine) -> Injector | None:
    """Hook the engine's phases when ``FSSDP_FAULTS`` names faults for this rank and attempt."""
    text = os.environ.get(ENV, "")
    if not text.strip():
        return None
    from deepspeed import comm as dist
    injector = Injector(parse(text), rank=dist.get_rank(),
                        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), engine=engine)
    if not injector.pending:
        return None
    _hook(engine, injector)
    return injector


def _hook(engine, injector: Injector) -> None:
    """Hooks and wrappers on this process's engine and checkpoint functions (one engine per process)."""
    from deepspeed.checkpoint import ds_to_universal

    from ds_fssdp.runtime import checkpoint
    point = injector.point
    engine.module.register_forward_pre_hook(lambda *_: point("forward"))
    first, last = engine.fssdp.layers[0], engine.fssdp.layers[-1]
    gate = getattr(first, "gate", None)
    if isinstance(gate, torch.nn.Module):  # FSSDPMoE's router
        gate.register_forward_hook(lambda *_: point("gate"))
    else:  # converted HF experts: the router ran before the experts' forward
        first.register_forward_pre_hook(lambda *_: point("gate"))
    last.register_full_backward_pre_hook(lambda *_: point("backward"))
    dispatcher = engine.fssdp.shards[0].dispatcher
    exchange = dispatcher._exchange
    dispatcher._exchange = lambda *args, **kwargs: (point("exchange"), exchange(*args, **kwargs))[1]
    optimizer_step = engine.optimizer.step
    engine.optimizer.step = lambda *args, **kwargs: (point("step"), optimizer_step(*args, **kwargs))[1]
    write = checkpoint.write_expert_files
    checkpoint.write_expert_files = lambda *args, **kwargs: (point("save"), write(*args, **kwargs))[1]
    # Inside DeepSpeed's converter, between extracting the ZeRO shards and merging them (rank 0
    # converts): a kill leaves a half-written .universal-tmp-<tag>.
    for name in ("_merge_tp_slice_files", "_merge_zero3_slice_files"):
        merge = getattr(ds_to_universal, name)
        setattr(ds_to_universal, name, lambda *a, _merge=merge, **k: (point("convert"), _merge(*a, **k))[1])
