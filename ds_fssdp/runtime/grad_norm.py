"""One global gradient norm over dense and expert gradients, inside DeepSpeed's own clipping
(docs/design.md section 5, the clipping paragraph, and section 9, "Norms and skips").

DeepSpeed computes the dense gradients' norm and scales them by one factor (loss-scale unscale and
clip). The experts' squared norm (summed over the group, each expert counted once) is folded into
that norm where DeepSpeed computes it, which depends on its optimizer wrapper: the engine's
``clip_fp32_gradients`` (ZeRO 0 fp32, the FSSDP engine calls :meth:`ExpertNorm.clip_dense_fp32`),
``DeepSpeedZeroOptimizer.scaled_global_norm`` (ZeRO 1/2), ZeRO 3's ``_get_norm_groups`` and
``FP16_(Unfused)Optimizer.unscale_and_clip_grads`` with the overflow check (ZeRO 0 bf16/fp16); any other wrapper with ``gradient_clipping > 0`` is refused. The expert
gradients are then scaled by the same factor. Under pipeline parallelism the ZeRO 0 clip sums the
dense squares over ``dense_group`` (the pipeline), a tied parameter counted on the first stage only.
"""
from __future__ import annotations

import math

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.utils import combine_grad_norm_groups
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ds_fssdp.config import FSSDPConfigError


class ExpertNorm:
    """Carries the experts' squared norm into DeepSpeed's step and the resulting factor out."""

    def __init__(self, clip: float, *, dense_group=None, dense_skip=frozenset()):
        self.clip = float(clip)
        self.expert_sq = None  # float tensor: sum over the group of squared expert gradients
        self.factor = 1.0  # multiply the expert gradients by this before their step
        self.global_norm = None  # dense + expert, unscaled
        self.dense_group = dense_group  # pipeline parallelism: the dense squares are summed over it (ZeRO 0)
        self.dense_skip = dense_skip  # ids of parameters another stage counts (tied copies)

    def arm(self, expert_sq: torch.Tensor, loss_scale: float) -> None:
        self.expert_sq = expert_sq
        self.factor = 1.0 / loss_scale
        self.global_norm = None

    def disarm(self) -> float:
        self.expert_sq = None
        return self.factor

    def _set(self, combined: float, loss_scale: float) -> None:
        """DeepSpeed's rule: divide by loss_scale * max(1, (norm / loss_scale + 1e-6) / clip)."""
        scale = loss_scale
        if self.clip > 0 and math.isfinite(combined):
            c = (combined / loss_scale + 1e-6) / self.clip
            if c > 1:
                scale = c * loss_scale
        self.factor = 1.0 / scale
        self.global_norm = combined / loss_scale

    def clip_dense_fp32(self, engine) -> None:
        """ZeRO 0 fp32: clip dense gradients (already all-reduced, equal on every rank) on the
        combined norm, as DeepSpeed's ``clip_grad_norm_`` would on the dense ones alone."""
        params = [p for p in engine.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        dense_sq = sum((p.grad.detach().float().pow(2).sum() for p in params if id(p) not in self.dense_skip),
                       torch.zeros(()))
        if self.dense_group is not None:
            dense_sq = dense_sq.to(self.expert_sq.device)
            dist.all_reduce(dense_sq, group=self.dense_group)
        combined = float((dense_sq.cpu() + self.expert_sq.cpu()).sqrt())
        coef = min(1.0, self.clip / (combined + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        self.factor = coef
        self.global_norm = combined
        engine._global_grad_norm = combined


def install_expert_norm(engine, *, dense_group=None) -> ExpertNorm:
    opt = engine.optimizer
    clip = engine.gradient_clipping()
    # DeepSpeed marks a tied module's parameters on every pipeline stage but the first that holds it.
    tied = frozenset(id(p) for p in engine.module.parameters() if getattr(p, "ds_pipe_replicated", False))
    hook = ExpertNorm(clip, dense_group=dense_group, dense_skip=tied)
    if opt is None:  # an inference engine: nothing to clip
        return hook
    if isinstance(opt, DeepSpeedZeroOptimizer):
        _wrap_zero(opt, hook)
    elif isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        _wrap_zero3(opt, hook)
    elif isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        _wrap_fp16(opt, hook)
    elif isinstance(opt, BF16_Optimizer) or not isinstance(opt, torch.optim.Optimizer):
        if clip > 0:
            raise FSSDPConfigError(f"gradient_clipping ({clip}) with DeepSpeed's {type(opt).__name__} is not "
                                   "supported by fssdp (use ZeRO 0/1/2 without grad_accum_dtype fp32, or "
                                   "gradient_clipping 0)")
    return hook


def loss_scale_of(opt) -> float:
    if isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return float(opt.loss_scale)
    return float(opt.loss_scale_config.cur_scale) if isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer)) else 1.0


def _wrap_zero(opt, hook: ExpertNorm) -> None:
    orig = opt.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        dense = orig(norm_type)
        if hook.expert_sq is None:
            return dense
        combined = combine_grad_norm_groups([dense, hook.expert_sq.to(dense.device, torch.float32).sqrt()])
        hook._set(float(combined), float(opt.loss_scale))
        return combined

    opt.scaled_global_norm = scaled_global_norm


def _wrap_zero3(opt, hook: ExpertNorm) -> None:
    orig = opt._get_norm_groups

    def get_norm_groups():
        groups = orig()  # each already reduced over the data-parallel group
        if hook.expert_sq is None:
            return groups
        device = groups[0].device if groups and torch.is_tensor(groups[0]) else hook.expert_sq.device
        groups = list(groups) + [hook.expert_sq.to(device, torch.float32).sqrt()]
        hook._set(float(combine_grad_norm_groups(groups)), float(opt.loss_scale))
        return groups

    opt._get_norm_groups = get_norm_groups


def _wrap_fp16(opt, hook: ExpertNorm) -> None:
    orig_unscale = opt.unscale_and_clip_grads
    norm_pos = 0 if isinstance(opt, FP16_UnfusedOptimizer) else 1

    def unscale_and_clip_grads(*args, **kwargs):
        args = list(args)
        if hook.expert_sq is not None:
            dense = float(args[norm_pos])
            combined = math.sqrt(dense * dense + float(hook.expert_sq))
            args[norm_pos] = combined
            opt._global_grad_norm = combined
            hook._set(combined, float(opt.loss_scale_config.cur_scale))
        return orig_unscale(*args, **kwargs)

    opt.unscale_and_clip_grads = unscale_and_clip_grads
    checker = opt.overflow_checker

    def or_expert_overflow(orig_check):
        return lambda *args, **kwargs: orig_check(*args, **kwargs) or (
            hook.expert_sq is not None and not math.isfinite(float(hook.expert_sq)))

    for name in ("check", "has_overflow", "check_using_norm"):
        if getattr(checker, name, None) is not None:
            setattr(checker, name, or_expert_overflow(getattr(checker, name)))
