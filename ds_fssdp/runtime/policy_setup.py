"""The stage's policy and what it decides with, built once at attach (``FSSDPStage.attach``): the
"auto" materialization budget, the cost model (``fssdp.hardware``'s, else measured on this machine
and agreed by every rank) and the schedule's costs under ``fssdp.hardware``; the policy object
with each layer's planner is ``planner.inputs.build_policies`` (the report's replay builds it too).

Every rank builds the same ones: the decisions decide the collectives. Only the measured cost
model talks to other ranks (``runtime/profile.py``'s link measurement inside the FSSDP group, and
its agreement over the data-parallel ranks: every FSSDP group re-shards with t from this model, so
all hold the same one); the rest is local. The schedule's costs fitted on this machine are
``runtime/costfit.py``'s.
"""
from __future__ import annotations

import dataclasses

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.config import FSSDPConfig
from ds_fssdp.planner import Hardware, auto_materialization_budget
from ds_fssdp.planner.cost import schedule_costs
from ds_fssdp.planner.schedule import ScheduleCosts
from ds_fssdp.planner.scheduled import ScheduledCostModel
from ds_fssdp.runtime.profile import measure_expert_flops, measure_link_bandwidth


def auto_budget(config: FSSDPConfig, *, expert_bytes: int, num_layers: int, in_flight: int = 1) -> int:
    """``fssdp.materialization_budget`` "auto": the replicas that fit ``replica_memory_bytes``
    (``in_flight``: micro-batches awaiting their backward at once, a pipeline stage's)."""
    budget = auto_materialization_budget(memory_bytes=config.replica_memory_bytes, expert_bytes=expert_bytes,
                                         num_layers=num_layers, rematerialize=config.rematerialize,
                                         in_flight=in_flight)
    logger.info(f"fssdp: materialization_budget auto -> m = {budget} ({config.replica_memory_bytes} bytes "
                f"for replicas, {expert_bytes} bytes per expert, {num_layers} layers, {in_flight} micro-batches in "
                f"flight, rematerialize={config.rematerialize})")
    return budget


def needs_cost_model(config: FSSDPConfig, *, edp_size: int) -> bool:
    """Whether a decision needs a cost model: calibration, FasterMoE, time-balanced dispatch,
    "auto" overlap degree, or gradients in the gaps over several FSSDP groups with
    ``fssdp.hardware`` (it plans its slices on a configured cost model, never measured for it
    alone: without one the slice is the fixed default)."""
    return bool(config.calibration or config.policy == "fastermoe" or config.dispatch == "balanced-time"
                or config.overlap_degree == "auto"
                or (config.grads_in_gaps and edp_size > 1 and config.hardware is not None))


def configured_hardware(hardware) -> Hardware:
    """``fssdp.hardware`` as the planner's :class:`Hardware`."""
    return Hardware(flops=float(hardware.flops), intra_bw=float(hardware.intra_bw),
                    inter_bw=float(hardware.inter_bw), latency=float(hardware.latency))


def cost_model(config: FSSDPConfig, *, spec, shape, topology, group, expert_bytes: int, exchange,
               agree_group, dtype, device, costs=None) -> tuple:
    """The hardware from ``fssdp.hardware``, else measured (link bandwidth over ``group``, expert
    GEMM speed of ``spec``), agreed on by every rank of ``agree_group`` (None: the world): the
    decisions decide the collectives, and with several FSSDP groups the re-shards' t comes from
    this model, so every group must hold the same one or they plan different owners. ``shape``:
    the expert's cost shape, ``exchange``: how the layers exchange their tokens
    (``FSSDPStage.exchange_options``), ``costs``: the schedule's costs it prices layers with
    (``ScheduledCostModel``'s). Returns the ``ScheduledCostModel`` and the profile
    entries (``link_bandwidth`` when measured, ``hardware``, ``expert_shape``)."""
    profile = {}
    if config.hardware is not None:
        hw = configured_hardware(config.hardware)
    else:
        bw = measure_link_bandwidth(group=group, chunk_bytes=expert_bytes, device=device, agree_group=agree_group)
        profile["link_bandwidth"] = bw
        flops_t = torch.tensor([measure_expert_flops(spec, dtype=dtype, device=device)],
                               dtype=torch.float64, device=device)
        dist.all_reduce(flops_t, op=dist.ReduceOp.MIN, group=agree_group)
        bw = bw if bw != float("inf") else 1e15
        hw = Hardware(flops=float(flops_t), intra_bw=bw, inter_bw=bw)
        logger.info(f"fssdp: measured link bandwidth {bw / 1e9:.2f} GB/s per rank; overlap_degree "
                    f"{config.overlap_degree!r} (auto: per layer from its measured attention window)")
    profile["hardware"] = dataclasses.asdict(hw)
    profile["expert_shape"] = dataclasses.asdict(shape)
    return ScheduledCostModel(hw, shape, topology, exchange=exchange, costs=costs), profile


def configured_schedule_costs(hardware, shape) -> ScheduleCosts:
    """What "auto" pipeline degrees and one copy per destination are chosen from under
    ``fssdp.hardware`` (a modelled device: exchanges concurrent with the compute; the same on
    every rank and in every run, nothing is measured); collective startup is the hardware's
    latency."""
    return schedule_costs(configured_hardware(hardware), shape)
