"""FSSDP inside every stage of DeepSpeed's pipeline engine (a ``PipelineModule``). What DeepSpeed
0.19.8's ``PipelineEngine`` does (read in its code, checked on 4 gloo ranks), the groups, the
per-micro-batch records, the step, the norms and the refusals: docs/design.md section 9.

Legend: S pipeline stages, dp data-parallel ranks per stage, G micro-batches per step (gradient
accumulation steps), W = S * dp ranks.

Here: the refusals, by name before any collective (:func:`check_pipeline`; what depends on the MoE
layers is decided on every stage's layers on every rank, :func:`every_stage_modules`, so every rank
refuses alike); the FSSDP engine class's instruction map (:func:`instruction_map`: DeepSpeed binds
the class-level ``_INSTRUCTION_MAP``'s functions per call, so a subclass's ``_exec_backward_pass``
is never called), whose ForwardPass declares each training forward (``FSSDPStage.begin_forward``,
``moe/records.py``), whose BackwardPass counts the G-th as the accumulation boundary (DeepSpeed's
``is_gradient_accumulation_boundary()`` is false in all of them) and whose OptimizerStep runs the
stage's step; ``train_batch`` and ``eval_batch`` returning DeepSpeed's loss plus the auxiliary terms
averaged like it (:class:`PipelineRun`; ``moe/aux_loss.AuxLossToBackward``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
from deepspeed.runtime.pipe.engine import PipelineError
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from torch import nn

from ds_fssdp.config import FSSDPConfigError
from ds_fssdp.moe.aux_loss import AuxLossToBackward
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.runtime.grad_norm import loss_scale_of
from ds_fssdp.runtime.sequence_parallel import sequence_parallel_size
from ds_fssdp.runtime.tensor_parallel import tensor_parallel_size

# What the FSSDP engine runs: DeepSpeed's 1F1B train schedule and its inference schedule.
SCHEDULES = (schedule.TrainSchedule, schedule.InferenceSchedule)


@dataclass(frozen=True)
class PipelineLayout:
    """The pipeline's ranks, read from the module's topology (no collective)."""
    num_stages: int
    stage_id: int
    stages: tuple  # each stage's data-parallel ranks (global, ascending, consecutive)
    dp_group: object  # this stage's data-parallel group (DeepSpeed's)
    pipe_group: object  # this rank's pipeline (DeepSpeed's)

    @property
    def dp_size(self) -> int:
        return len(self.stages[self.stage_id])


def check_pipeline(ds_config: dict, model, *, mpu=None, mesh_param=None) -> PipelineLayout:
    """Refuse what FSSDP does not run under pipeline parallelism, naming it, before any collective;
    returns the layout."""
    if isinstance(model, DualPipeVModule):
        raise FSSDPConfigError("fssdp with pipeline parallelism runs DeepSpeed's TrainSchedule (1F1B) only; the model "
                               "is a DualPipeVModule (DualPipeVSchedule)")
    zero = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if zero >= 2:
        raise FSSDPConfigError(f"zero_optimization.stage ({zero}) with pipeline parallelism: DeepSpeed's pipeline "
                               "engine supports ZeRO 0 and 1 only (use stage 0 or 1)")
    _check_precision(ds_config, zero)
    sp = sequence_parallel_size(ds_config, mpu=mpu, mesh_param=mesh_param)
    if mpu is not None or mesh_param is not None or sp > 1:
        raise FSSDPConfigError("fssdp with pipeline parallelism takes no mpu, mesh_param or sequence_parallel_size "
                               "(the PipelineModule's grid is the topology; Ulysses sequence parallelism is not "
                               "combined with it)")
    tp = tensor_parallel_size(ds_config)
    if tp > 1:
        raise FSSDPConfigError(f"tensor_parallel.autotp_size ({tp}) with pipeline parallelism is not supported by "
                               "fssdp")
    topo = model.topology()
    axes = topo.get_axis_names()
    extra = {a: topo.get_dim(a) for a in axes if a not in ("pipe", "data") and topo.get_dim(a) > 1}
    if extra:
        raise FSSDPConfigError(f"fssdp with pipeline parallelism: the topology's axes {extra} slice the model (tensor "
                               "parallelism); only pipe and data are supported")
    num_stages = topo.get_dim("pipe")
    stages = tuple(tuple(sorted(topo.filter_match(pipe=s))) for s in range(num_stages))
    for s, ranks in enumerate(stages):
        if list(ranks) != list(range(ranks[0], ranks[0] + len(ranks))):
            raise FSSDPConfigError(f"fssdp with pipeline parallelism needs each stage's data-parallel ranks "
                                   f"consecutive (PipeDataParallelTopology: axes pipe, data); stage {s} has ranks "
                                   f"{list(ranks)} (topology axes {axes})")
    check_stage_parts(list(model.parts))
    _check_tied(model)
    grid = model._grid
    return PipelineLayout(num_stages=num_stages, stage_id=grid.get_stage_id(), stages=stages,
                          dp_group=grid.get_data_parallel_group(), pipe_group=grid.get_pipe_parallel_group())


def _check_precision(ds_config: dict, zero: int) -> None:
    """The half-precision optimizers whose norm DeepSpeed computes from stage 0's parameters only
    (the grid reports the stage as the model-parallel rank): fp16 at ZeRO 0 (FP16_Optimizer), and
    bf16 where DeepSpeed's pipeline engine picks its BF16_Optimizer: at ZeRO 0 always (its state
    is partitioned over the data-parallel ranks, which DeepSpeed's ZeRO 0 load cannot read back:
    ``load_state_dict`` indexes one dict by the data-parallel rank), at ZeRO 1 with
    ``data_types.grad_accum_dtype`` fp32 when ``gradient_clipping`` > 0 (DeepSpeed's default 1.0)."""
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled", False))
    if fp16 and zero == 0:
        raise FSSDPConfigError("fp16.enabled (true) at zero_optimization.stage 0 with pipeline parallelism: "
                               "DeepSpeed's fp16 optimizer clips with stage 0's norm only; use ZeRO stage 1")
    bf16 = bool((ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False))
    if bf16 and zero == 0:
        raise FSSDPConfigError("bf16.enabled (true) at zero_optimization.stage 0 with pipeline parallelism: "
                               "DeepSpeed's BF16_Optimizer steps it, whose norm (clipping, non-finite check) counts "
                               "stage 0's parameters only and whose state a ZeRO 0 checkpoint cannot resume; use ZeRO "
                               "stage 1")
    clip = float(ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
    accum = str((ds_config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    if bf16 and clip > 0 and accum in ("fp32", "float32", "float", "torch.float32"):
        raise FSSDPConfigError(f"bf16.enabled (true) with data_types.grad_accum_dtype ({accum!r}), gradient_clipping "
                               f"({clip}) and pipeline parallelism: DeepSpeed's BF16_Optimizer clips with stage 0's "
                               "norm only, not the global one; use bf16 gradient accumulation or gradient_clipping 0")


def check_stage_parts(parts: list) -> None:
    """Every stage holds at least one layer (``parts``: the PipelineModule's stage boundaries)."""
    empty = [s for s in range(len(parts) - 1) if parts[s + 1] <= parts[s]]
    if empty:
        raise FSSDPConfigError(f"fssdp with pipeline parallelism: pipeline stage(s) {empty} of {len(parts) - 1} hold "
                               f"no layer (the PipelineModule's stage boundaries {parts}); give every stage a layer "
                               "or use fewer stages")


def _meta_build(spec):
    """A spec built on the meta device (no memory, the RNG untouched), to look inside."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return spec.build()


def every_stage_modules(model) -> list:
    """Every stage's layers as modules (a list per stage), the same on every rank, without a
    collective: this stage's as built, another stage's ``nn.Module`` layers as given and its
    ``LayerSpec`` layers built on the meta device; functions are left out."""
    tied, out = {}, []
    for s in range(len(model.parts) - 1):
        mods = []
        for idx in range(model.parts[s], model.parts[s + 1]):
            spec = model._layer_specs[idx]
            if isinstance(spec, nn.Module):
                mods.append(spec)
            elif isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = (model.tied_modules[spec.key] if spec.key in model.tied_modules else
                                      _meta_build(spec))
                mods.append(tied[spec.key])
            elif isinstance(spec, LayerSpec):
                local = model._modules.get(str(idx))
                mods.append(local if local is not None else _meta_build(spec))
        out.append(mods)
    return out


def whole_model(model) -> nn.ModuleList:
    """Every stage's layers in one module, for the checks that look at the MoE layers: each rank
    decides on all of them, so a layer only one stage holds is refused on every rank alike."""
    return nn.ModuleList([m for mods in every_stage_modules(model) for m in mods])


def check_layers(whole: nn.Module) -> None:
    """What ``FSSDPStage`` asks of each MoE layer, asked of every stage's before any collective."""
    for layer in whole.modules():
        if isinstance(layer, FSSDPExperts):
            layer.trainable  # an expert's tensors train or freeze together (ValueError by name)


def _check_tied(model) -> None:
    """FSSDP layers inside a ``TiedLayerSpec`` are refused on every rank alike: the specs not built on
    this stage are built on the meta device to look inside."""
    for spec in model._layer_specs:
        if not isinstance(spec, TiedLayerSpec):
            continue
        built = model.tied_modules[spec.key] if spec.key in model.tied_modules else _meta_build(spec)
        if any(isinstance(m, FSSDPExperts) for m in built.modules()):
            raise FSSDPConfigError(f"fssdp layers inside a TiedLayerSpec (key {spec.key!r}, {spec.typename.__name__}) "
                                   "are not supported: a tied module is replicated on several stages, FSSDP shards "
                                   "its experts over one stage")


def check_stage_nodes(layout: PipelineLayout, ranks_per_node: int) -> None:
    """A stage's data-parallel ranks span whole nodes or lie inside one (before any collective)."""
    dp = layout.dp_size
    if dp % ranks_per_node and ranks_per_node % dp:
        raise FSSDPConfigError(f"fssdp.ranks_per_node ({ranks_per_node}) and the pipeline stages' data-parallel size "
                               f"({dp}): a stage must span whole nodes or lie inside one")


def global_layer_indices(num_local: int, layout: PipelineLayout) -> tuple:
    """``(indices, total)``: each local MoE layer's index among all stages' MoE layers (stage order)
    and their number. Collective over the world (one small all-gather)."""
    device = get_accelerator().current_device_name()
    mine = torch.tensor([layout.stage_id, num_local], dtype=torch.long, device=device)
    every = torch.empty(dist.get_world_size() * 2, dtype=torch.long, device=device)
    dist.all_gather_into_tensor(every, mine)
    counts = {}
    for stage, n in every.view(-1, 2).tolist():
        if counts.setdefault(stage, n) != n:
            raise RuntimeError(f"fssdp: the ranks of pipeline stage {stage} hold different numbers of MoE layers")
    offset = sum(counts[s] for s in range(layout.stage_id))
    return list(range(offset, offset + num_local)), sum(counts.values())


class PipelineRun:
    """What the FSSDP pipeline engine counts over one batch."""

    def __init__(self, aux: list):
        self.aux = list(aux)  # the stage's AuxLossToBackward modules
        self.backwards = 0  # BackwardPasses run in this batch

    def start(self) -> None:
        self.backwards = 0
        for m in self.aux:
            m.reset_total()

    def set_aux_scale(self, scale: float) -> None:
        for m in self.aux:
            m.scale = scale

    def with_aux(self, loss: torch.Tensor, *, dp: int, micro_batches: int) -> torch.Tensor:
        """``loss`` plus the auxiliary terms of this batch's forwards, summed over every stage and
        averaged over the data-parallel ranks and micro-batches, as DeepSpeed averages the loss
        (collective over the world: stages without such terms join with 0)."""
        total = torch.zeros((), dtype=torch.float32, device=loss.device)
        for m in self.aux:
            if m.total is not None:
                total += m.total.to(loss.device)
        dist.all_reduce(total)
        return loss + (total / (dp * micro_batches)).to(loss.dtype)


def trace_file(trace_path: str | None, layout: PipelineLayout | None, *, rank: int, global_layers: list) -> str | None:
    """Where this rank writes the trace of its stage's MoE layers (None: it does not): rank 0 without
    pipeline parallelism; else each stage's first rank, the stage holding MoE layer 0 at
    ``fssdp.trace_path``, stage s at ``<trace_path stem>.stage<s>.npz`` (docs/design.md, section 9)."""
    if layout is None:
        return trace_path if rank == 0 else None
    if not trace_path or not global_layers or rank != layout.stages[layout.stage_id][0]:
        return None
    if global_layers[0] == 0:
        return trace_path
    stem = trace_path[:-len(".npz")] if trace_path.endswith(".npz") else trace_path
    return f"{stem}.stage{layout.stage_id}.npz"


def attach(engine, layout: PipelineLayout) -> None:
    """After ``FSSDPStage.attach``: what the pipeline adds to the engine."""
    engine.fssdp_layout = layout
    engine.fssdp_pipe = PipelineRun([m for m in engine.module.modules() if isinstance(m, AuxLossToBackward)])


class FSSDPPipelineMixin:
    """The FSSDP engine's pipeline half (before ``FSSDPEngineMixin`` and ``PipelineEngine``)."""

    def train_batch(self, data_iter=None):
        run = self.fssdp_pipe
        run.start()
        loss = super().train_batch(data_iter)
        if run.backwards != self.micro_batches:
            raise RuntimeError(f"fssdp: {run.backwards} backward passes ran in a batch of {self.micro_batches} "
                               "micro-batches")
        self.agg_train_loss = run.with_aux(loss, dp=self.fssdp_layout.dp_size, micro_batches=self.micro_batches)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        """DeepSpeed's, plus the auxiliary terms when it returns the averaged loss on every rank."""
        self.fssdp_pipe.start()
        out = super().eval_batch(data_iter, return_logits=return_logits, compute_loss=compute_loss,
                                 reduce_output=reduce_output, bcast_loss=bcast_loss,
                                 num_micro_batches=num_micro_batches)
        if not (compute_loss and bcast_loss and reduce_output == "avg"):
            return out
        loss, rest = (out[0], out[1:]) if return_logits else (out, ())
        loss = self.fssdp_pipe.with_aux(loss, dp=self.fssdp_layout.dp_size,
                                        micro_batches=num_micro_batches or self.micro_batches)
        return (loss, *rest) if return_logits else loss

    def _exec_schedule(self, pipe_schedule):
        if type(pipe_schedule) not in SCHEDULES:
            raise FSSDPConfigError(f"fssdp with pipeline parallelism runs DeepSpeed's TrainSchedule (1F1B) and "
                                   f"InferenceSchedule only; the engine was given {type(pipe_schedule).__name__}")
        return super()._exec_schedule(pipe_schedule)

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")


def instruction_map(base: dict) -> dict:
    """DeepSpeed's instruction map with ForwardPass, BackwardPass and OptimizerStep wrapped."""
    wrapped = dict(base)
    wrapped[schedule.ForwardPass] = _forward_pass(base[schedule.ForwardPass])
    wrapped[schedule.BackwardPass] = _backward_pass(base[schedule.BackwardPass])
    wrapped[schedule.OptimizerStep] = _optimizer_step(base[schedule.OptimizerStep])
    return wrapped


def _forward_pass(run_forward):

    def forward_pass(self, buffer_id):
        training = self.module.training
        if training:
            self.fssdp.begin_forward()  # its own records (moe/records.py)
        run_forward(self, buffer_id)
        if training and self.fssdp.trace is not None:
            self.fssdp.record_trace(self.loss if self.is_last_stage() else None, clear=False)

    return forward_pass


def _backward_pass(run_backward):

    def backward_pass(self, buffer_id):
        run = self.fssdp_pipe
        run.backwards += 1
        self.fssdp.before_backward(run.backwards == self.micro_batches)  # the boundary: the G-th
        run.set_aux_scale(loss_scale_of(self.optimizer) / self.gradient_accumulation_steps())
        run_backward(self, buffer_id)
        if self.is_last_stage():
            self.fssdp.health.observe_loss(self.loss)
        self.fssdp.after_backward()

    return backward_pass


def _optimizer_step(run_step):

    def optimizer_step(self, lr_kwargs=None):
        self.fssdp.before_step(self)
        run_step(self, lr_kwargs)
        self.fssdp.after_step(self)
        self.fssdp_monitor.after_step(self)

    return optimizer_step
