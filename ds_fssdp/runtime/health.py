"""Keeping a run honest: combinations refused before any collective, non-finite steps skipped (or
raised) before they reach any optimizer state, collective timeouts, and the deterministic mode.

Non-finite steps. Every rank notes on the device (no host sync) whether a loss it back-propagated
was NaN/Inf; at the optimizer step the stage adds +inf for such a rank to the expert gradients'
squared norm before its all-reduce, so one all-reduce already in the step tells every rank the
same thing: the step is non-finite when that global norm is. Then, with ``fssdp.nonfinite``
"skip" (default), neither the dense nor the expert optimizer steps (DeepSpeed's own overflow path
runs: gradients zeroed, ``engine.skipped_steps`` counted, the LR scheduler not advanced, as it
does for an fp16 overflow) and a warning names the step and the ranks whose loss was non-finite;
with "raise" every rank raises ``FloatingPointError`` before anything is updated.

What is detected: a non-finite loss on any rank, or a non-finite expert gradient. A dense-only
gradient overflow under a finite loss stays DeepSpeed's business (its fp16 loss scaler, its ZeRO
1/2 invalid-norm check).
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from datetime import timedelta

import torch
from deepspeed.utils import logger

from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.runtime.checkpoint.files import patched


# -- combinations refused before any collective ------------------------------------------------
def check_combinations(ds_config: dict, fcfg: FSSDPConfig, *, model) -> None:
    """Refuse what FSSDP cannot run, naming the keys and values (called before any collective).

    Expert counts and rank counts: no combination is refused. ``E < D`` leaves ranks without a
    shard (they compute replicas), uneven shards are allowed, a budget or overlap degree above
    the expert count is simply not reached, and heterogeneous re-sharding spreads the L * E slots
    over the ranks with at most one slot of difference, which exists for every L, E and D. What
    cannot work is refused here: different expert counts per layer where the plan spans layers.
    """
    from ds_fssdp.moe.experts_module import FSSDPExperts
    ep = ds_config.get("expert_parallel") or {}
    if isinstance(ep, dict) and ep.get("enabled", False):
        raise FSSDPConfigError("expert_parallel.enabled (true) is DeepSpeed AutoEP, which shards experts itself; "
                               "it cannot be combined with fssdp (remove one of the two sections)")
    experts = [m for m in model.modules() if isinstance(m, FSSDPExperts)] if model is not None else []
    if fcfg.router_bias_update_rate and experts and not any(m.router_bias is not None for m in experts):
        raise FSSDPConfigError(f"fssdp.router_bias_update_rate ({fcfg.router_bias_update_rate}) is set, but no MoE "
                               "layer has a router selection bias to update (e_score_correction_bias of a converted "
                               "HF model, or FSSDPMoE(aux_free_bias=True))")
    num_E = [m.num_experts for m in experts]
    if len(set(num_E)) > 1:
        for key, value, active in (("reshard_interval", fcfg.reshard_interval, bool(fcfg.reshard_interval)),
                                   ("trace_path", fcfg.trace_path, bool(fcfg.trace_path)),
                                   ("policy", fcfg.policy, fcfg.policy in ("fastermoe", "smartmoe"))):
            if active:
                raise FSSDPConfigError(f"fssdp.{key} ({value!r}) needs the same number of experts in every MoE "
                                       f"layer, got {num_E}")


# -- collective timeout and deterministic mode ---------------------------------------------------
def apply_run_settings(fcfg: FSSDPConfig, groups: list) -> None:
    """At initialize: the collective timeout on ``groups`` (None is the default group) and the
    deterministic mode."""
    if fcfg.collective_timeout_s is not None:
        set_collective_timeout(float(fcfg.collective_timeout_s), groups)
    if fcfg.deterministic:
        enable_deterministic()


def set_collective_timeout(seconds: float, groups: list) -> None:
    """Make a collective that waits longer than ``seconds`` (a dead or hung peer) raise on every
    waiting rank. gloo reports a peer whose process died at once (its connections close); a peer
    that hangs, or NCCL (whose watchdog then aborts the process), needs this timeout."""
    from torch.distributed import distributed_c10d as c10d
    if not hasattr(c10d, "_set_pg_timeout"):
        raise FSSDPConfigError(f"fssdp.collective_timeout_s ({seconds}) needs torch.distributed._set_pg_timeout "
                               f"(torch {torch.__version__} lacks it); set DEEPSPEED_TIMEOUT (minutes) instead")
    for group in groups:
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    logger.info(f"fssdp: collectives time out after {seconds} s ({len(groups)} process groups)")


def enable_deterministic() -> None:
    """Bitwise-reproducible kernels: torch's deterministic algorithms (``index_add_``/``index_select``
    backward and ``index_put_(accumulate=True)`` sort instead of racing atomics on CUDA), cuDNN
    without autotuning, and the cuBLAS workspace setting deterministic GEMMs need."""
    if torch.cuda.is_available() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # Read when cuBLAS creates its handle: export it at launch if a matmul ran before this.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    logger.info("fssdp: deterministic mode (torch.use_deterministic_algorithms, cudnn.deterministic, "
                f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')})")


# -- non-finite steps ----------------------------------------------------------------------------
class NonFiniteGuard:
    """Notes non-finite losses per rank and decides, with every rank agreeing, whether a step is
    skipped (``mode`` "skip") or raises ("raise")."""

    def __init__(self, mode: str = "skip"):
        self.mode = mode  # fssdp.nonfinite, checked by the config
        self._bad = None  # device tensor: this rank's non-finite losses since the last step
        self.skip = False  # the step in progress is skipped (every rank agrees)
        self.skipped_steps = 0
        self.last = None  # what the last skipped step reported

    def observe_loss(self, loss) -> None:
        if not torch.is_tensor(loss):
            return
        bad = (~torch.isfinite(loss.detach())).sum()
        self._bad = bad if self._bad is None else self._bad + bad

    def loss_flag(self, like: torch.Tensor) -> torch.Tensor:
        """+inf if a loss on this rank was non-finite since the last step, else 0 (on ``like``'s
        device; added to the expert squared norm before its all-reduce)."""
        if self._bad is None:
            return torch.zeros((), dtype=like.dtype, device=like.device)
        return torch.where(self._bad.to(like.device) > 0, math.inf, 0.0).to(like.dtype)

    def decide(self, expert_sq, *, step: int, rank: int, shards=()) -> bool:
        """At the optimizer step, after the all-reduce: True if this step must be skipped."""
        local_bad = int(self._bad) if self._bad is not None else 0
        self._bad = None
        self.skip = expert_sq is not None and not math.isfinite(float(expert_sq))
        if not self.skip:
            return False
        layers = [i for i, s in enumerate(shards)
                  if s.master.grad is not None and not bool(torch.isfinite(s.master.grad).all())]
        detail = (f"rank {rank}: {local_bad} non-finite loss(es) since the last step, non-finite expert gradients "
                  f"in MoE layers {layers}")
        self.last = {"step": step, "local_nonfinite_losses": local_bad, "local_nonfinite_layers": layers}
        if local_bad or layers:
            logger.warning(f"fssdp: step {step}: {detail}")
        if self.mode == "raise":
            raise FloatingPointError(f"fssdp: step {step}: the loss or the gradients are not finite (global expert "
                                     f"gradient norm^2 {float(expert_sq)}); {detail} (fssdp.nonfinite \"raise\")")
        self.skipped_steps += 1
        if rank == 0:
            logger.warning(f"fssdp: step {step}: the loss or the gradients are not finite on some rank; skipping "
                           f"the optimizer step for dense and expert parameters ({self.skipped_steps} skipped so far)")
        return True


@contextmanager
def skipped_optimizer_step(optimizer):
    """Run DeepSpeed's ``_take_model_step`` through its overflow path whatever the wrapper: no
    parameter or optimizer state changes, gradients are zeroed, ``skipped_steps`` counts it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, BF16_Optimizer):
        # Its norm covers dense gradients only: take its invalid-norm branch by hand.
        def skip(*args, **kwargs):
            optimizer.overflow = True
            optimizer.clear_hp_grads()
            optimizer.clear_lp_grads()

        with patched(optimizer, "step", skip):
            yield
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        # Its own overflow branch clears the partitioned gradients and buffers; bf16 skips the
        # check unless told, so force both the check and its answer.
        with patched(optimizer, "check_grad_overflow", True), patched(
                optimizer, "check_overflow", lambda partition_gradients=True: setattr(optimizer, "overflow", True)):
            yield
    elif hasattr(optimizer, "overflow"):
        # FP16_Optimizer / FP16_UnfusedOptimizer: their overflow check already ORs in the
        # non-finite expert norm (grad_norm.py), so they take their own overflow path.
        yield
    else:
        # A torch optimizer (ZeRO 0, fp32) or another wrapper without an overflow flag.
        with patched(optimizer, "step", lambda *args, **kwargs: None), patched(optimizer, "overflow", True):
            yield
