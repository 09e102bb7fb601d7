"""The ``"fssdp"`` section of a DeepSpeed config: typed, validated, errors name the key and the value.

The section lives in the same JSON/HJSON file (or dict) that DeepSpeed reads; DeepSpeed ignores
unknown top-level keys, so it does not choke on it. Everything here is checked before any
collective runs: static values in :func:`FSSDPConfig.from_ds_config`, values that depend on the
world size in :meth:`FSSDPConfig.resolve_ranks_per_node` and :meth:`FSSDPConfig.resolve_group_size`.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationError

from ds_fssdp.defaults import DISPATCH_SLACK, POLICIES, SMARTMOE_INTERVAL  # noqa: F401 (POLICIES: re-exported)

SECTION = "fssdp"
PLACEMENTS = ("joint", "paper")
_AUTO_KEYS = ("materialization_budget", "overlap_degree")
NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]


class FSSDPConfigError(ValueError):
    """A bad value in the ``"fssdp"`` section (or a combination FSSDP refuses)."""


class _Strict(DeepSpeedConfigModel):

    def __init__(self, **data):
        # strict=True keeps DeepSpeedConfigModel from silently dropping "auto" values.
        super().__init__(strict=True, **data)


class HardwareConfig(_Strict):
    """Per-rank speeds for the cost model (``fssdp.hardware``)."""

    flops: Annotated[Union[StrictFloat, StrictInt], Field(gt=0)]
    """Achievable FLOP/s of the expert GEMMs."""

    intra_bw: Annotated[Union[StrictFloat, StrictInt], Field(gt=0)]
    """Bytes/s per rank inside a node."""

    inter_bw: Annotated[Union[StrictFloat, StrictInt], Field(gt=0)]
    """Bytes/s per node between nodes."""

    latency: Annotated[Union[StrictFloat, StrictInt], Field(ge=0)] = 1e-5
    """Seconds per collective phase."""


class PipelineDegreeConfig(_Strict):
    """``fssdp.pipeline_degree`` given per direction."""

    forward: Annotated[StrictInt, Field(ge=1)]
    backward: Annotated[StrictInt, Field(ge=1)]


class FSSDPConfig(_Strict):
    """Typed model of the ``"fssdp"`` section."""

    enabled: StrictBool = True
    """Shard experts with FSSDP. ``false`` leaves FSSDPMoE layers as ordinary modules, so DeepSpeed
    trains every expert data-parallel (all experts replicated on all ranks)."""

    policy: Literal["fssdp", "ep", "uniform", "fastermoe", "smartmoe"] = "fssdp"
    """``fssdp``: per-iteration ephemeral replicas. ``ep``: static expert parallelism (no replicas).
    Baselines, run for real for comparison: ``uniform`` (a gate that spreads tokens evenly over
    the experts: the no-straggler speed reference; it changes what the model computes),
    ``fastermoe`` (after gating, broadcast the experts worth it to every rank, on the critical
    path), ``smartmoe`` (every ``smartmoe_interval`` steps permute experts between ranks from the
    load history, moving their optimizer state)."""

    materialization_budget: Union[Literal["auto"], NonNegInt] = 2
    """m: extra expert replicas each rank may hold per MoE layer per iteration; "auto": as many as
    ``replica_memory_bytes`` holds (per layer with re-materialization)."""

    replica_memory_bytes: Optional[NonNegInt] = None
    """Per-rank memory for replicas (parameters and their gradients), for budget "auto"."""

    overlap_degree: Union[Literal["auto"], NonNegInt] = 4
    """t: at most this many distinct experts are replicated per layer per iteration; "auto": per
    layer, searched by the modelled layer time from the expert chunks the measured link moves
    during the layer's measured window (``planner/overlap.py``)."""

    pipeline_degree: Union[Literal["auto"], Annotated[StrictInt, Field(ge=1)], PipelineDegreeConfig] = "auto"
    """Chunks of each MoE layer's token exchange, pipelined with the expert compute
    (``moe/pipeline.py``): an int for both directions, ``{"forward": n, "backward": n}``, or
    "auto": per layer and iteration, ``planner.onecopy.choose_exchange`` on the stage's schedule
    costs and the agreed dispatch plan's traffic, priced as the exchange that runs (one copy per
    destination, two hops across nodes; every rank takes the same degrees). 1 (or
    both directions 1): the unchunked exchange. Results equal degree 1 up to fp32 summation order."""

    smartmoe_interval: StrictInt = Field(SMARTMOE_INTERVAL, ge=1)
    """Policy ``smartmoe``: re-permute experts every this many optimizer steps."""

    hardware: Optional[HardwareConfig] = None
    """The cost model's hardware for calibration and ``fastermoe`` (and the link bandwidth of
    "auto" t); null: measured at initialize (a short all-to-all and an expert GEMM)."""

    trace_path: Optional[str] = None
    """Record every training iteration's all-gathered ``tokens_ED`` of every layer to this trace
    (``docs/traces.md``; rank 0 writes, atomically, every 50 iterations and at exit)."""

    metrics_csv: Optional[str] = "fssdp_metrics.csv"
    """Rank 0 writes one row per optimizer step to this CSV file (relative paths from the working
    directory; truncated at initialize): per MoE layer the straggler factor, replicas, bytes
    gathered, reduced and exchanged, exposed gather/reduce seconds and the load-prediction error
    (docs/observability.md); null: no CSV. The same metrics also go to DeepSpeed's monitor
    (TensorBoard, W&B, CSV, Comet) whenever the DeepSpeed config enables one."""

    calibration_latency_budget: Optional[Annotated[Union[StrictFloat, StrictInt], Field(ge=0)]] = None
    """Seconds a calibration gather may add to the critical path; null: the layer's measured
    attention window."""

    rematerialize: StrictBool = False
    """Free replicas after the forward and gather them again for the backward (the expert MLP is
    recomputed in the backward): replica memory is about two adjacent layers' worth (a layer's and the
    next one's, gathered during its expert compute) instead of all layers'."""

    grads_in_gaps: StrictBool = True
    """Start each layer's expert gradient reduce over the EDP group during the backward of the layers
    below it, in slices sized to the gaps the schedule predicts; with several FSSDP groups, leave the
    step's all-gather of the updated slices (ZeRO >= 1), or a split sync and its update where the cost
    model says it pays (ZeRO 0), in flight until each layer's first use in the next forward
    (docs/design.md section 2, "Gradients / Parameters / Updates in the gaps"). ``false``: every
    layer's reduce and all-gather at the step, synchronously. The same sums and weights either way,
    up to fp32 summation order (bitwise with EDP groups of 2)."""

    topology_aware: StrictBool = True
    """Sparse collectives cross the inter-node link once per (expert, node) and are forwarded inside
    the node; gradients are summed inside a node before one partial sum leaves it. With
    ``one_copy_per_destination`` tokens too cross to a node once and are forwarded inside it."""

    one_copy_per_destination: Union[Literal["auto"], StrictBool] = True
    """A token crosses to a rank once, however many of its top-k experts that rank computes; the
    receiver expands it to its rows and returns one gate-weighted partial sum (moe/dedup.py); with
    ``topology_aware`` and several nodes it crosses to a node once, to a relay that forwards it
    inside the node. Same results up to fp32 summation order; false: one row per (token, expert)
    assignment. ``"auto"``: per layer and step, where the schedule's cost model says the layer is
    faster with it (``planner/onecopy.choose_exchange``: the rows it saves against its routing
    entries, gate weights and two small collectives), from the plan's traffic and the agreed costs
    (measured at initialize, or ``hardware``'s), so every rank takes the same decision. Not the
    default: with measured costs the choice, hence the fp32 summation order, can differ between a
    run and its resumption."""

    reshard_interval: StrictInt = Field(0, ge=0)
    """Re-plan the owners of all layers every this many optimizer steps (0: never)."""

    placement: str = "paper"
    """How replicas are chosen each iteration (``planner.place``): ``paper`` (Algorithm 1 on
    per-expert loads; the best measured, ``benchmarks/results/README.md``) or ``joint`` (where the
    predicted tokens come from, every slot that helps balance)."""

    dispatch: Literal["balanced", "balanced-time", "paper"] = "balanced"
    """How tokens are split among holders: ``balanced`` (fewest rows on the most loaded rank, then
    locality), ``balanced-time`` (the plan with the least modelled time: compute plus token
    exchange over the links, from ``hardware`` or measured), or ``paper`` (Algorithm 3: local,
    same node, all holders, split evenly)."""

    dispatch_slack: Annotated[Union[StrictFloat, StrictInt], Field(ge=0)] = DISPATCH_SLACK
    """``balanced`` dispatch: the busiest rank may compute this fraction more rows than the best
    possible, so fewer tokens leave their node. On the shared trace (8 ranks, 2 nodes, m = 2):
    slack 0 gives straggler 1.002 and 1.9% of tokens across nodes, 0.03 gives 1.033 and 0.9%
    (Algorithm 3: 1.351 and 1.2%)."""

    load_window: StrictInt = Field(5, ge=1)
    """w: the load predictor averages the last w iterations."""

    calibration: StrictBool = False
    """After gating, add replicas for the actual loads when the modelled gain exceeds the cost."""

    ranks_per_node: Union[Literal["auto"], PosInt, None] = "auto"
    """Ranks per node: "auto" or null (the launcher's local world size) or an int dividing the world
    size; an int smaller than the real node makes logical nodes on one machine. (The HF Trainer
    treats any "auto" string in a DeepSpeed config as its own placeholder: use null there.)"""

    group_size: Optional[PosInt] = None
    """Ranks per FSSDP group; null: the whole world (one group). Consecutive ranks form a group that
    holds one complete set of experts (one owner each) and plans, replicates, exchanges tokens and
    balances inside itself; the ranks at the same position in every group are the
    expert-data-parallel (EDP) group of the experts they own, whose gradients are averaged over it.
    Must divide the world size and be a multiple or a divisor of ``ranks_per_node``. With ZeRO stage
    >= 1 the expert fp32 masters and optimizer moments are partitioned over the EDP group (one copy
    in the world); with stage 0 they are replicated, as DeepSpeed does for dense parameters."""

    cost_refresh_interval: StrictInt = Field(50, ge=0)
    """Refit the schedule's cost model (the token exchange's and the expert GEMM's startup + rate,
    measured at initialize; ``runtime/costfit.py``) from the run's own timings of every layer's
    exchanges and GEMMs, agreed by every rank, every this many optimizer steps (0: never; the
    initial fit stays). Its fit error is the metric ``cost_fit_error``."""

    # -- robustness (runtime/health.py, runtime/checkpoint/, docs/determinism.md) --
    collective_timeout_s: Optional[Annotated[Union[StrictFloat, StrictInt], Field(gt=0)]] = None
    """Seconds a collective may wait for a peer before every waiting rank raises (a dead or hung
    rank), on the default process group and FSSDP's own; null: DeepSpeed's default
    (``DEEPSPEED_TIMEOUT`` minutes, 10)."""

    nonfinite: Literal["skip", "raise"] = "skip"
    """A step whose loss (on any rank) or expert gradients are NaN/Inf: ``skip`` (no dense or expert
    optimizer state changes, ``engine.skipped_steps`` counts it, a warning names the step and the
    ranks) or ``raise`` (``FloatingPointError`` on every rank before anything is updated)."""

    router_bias_update_rate: Annotated[Union[StrictFloat, StrictInt], Field(ge=0)] = 0.0
    """Auxiliary-loss-free balancing for routers with a selection bias (Hugging Face DeepSeek-V3
    family ``e_score_correction_bias`` and the like, which transformers never updates): after each
    optimizer step the bias moves by this rate times ``sign(mean load - expert load)``, loads
    counted over all ranks and micro-steps of the step. 0: off (the bias stays as loaded)."""

    deterministic: StrictBool = False
    """Bitwise-reproducible runs on GPU too: torch's deterministic algorithms, cuDNN without
    autotuning, and no decision taken from measured timings (docs/determinism.md)."""

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | None) -> "FSSDPConfig":
        """Parse the section out of a DeepSpeed config dict; a missing section means disabled."""
        section = (ds_config or {}).get(SECTION)
        if section is None:
            return cls(enabled=False)
        if not isinstance(section, Mapping):
            raise FSSDPConfigError(f"{SECTION} ({section!r}) must be an object of settings")
        try:
            cfg = cls(**dict(section))
        except ValidationError as err:
            raise FSSDPConfigError(_format_errors(err, section)) from None
        if cfg.placement not in PLACEMENTS:
            removed = " ('cost' was removed: it won on no cluster and no CPU run)" if cfg.placement == "cost" else ""
            raise FSSDPConfigError(f"{SECTION}.placement ({cfg.placement!r}) must be one of {PLACEMENTS}{removed}")
        if cfg.materialization_budget == "auto" and cfg.replica_memory_bytes is None:
            raise FSSDPConfigError(f"{SECTION}.materialization_budget (\"auto\") needs {SECTION}.replica_memory_bytes "
                                   "(per-rank bytes for replicas)")
        _check_deterministic(cfg)
        return cfg

    def pipeline_degrees(self):
        """"auto", or (forward, backward) degrees."""
        pd = self.pipeline_degree
        if pd == "auto":
            return "auto"
        return (pd, pd) if isinstance(pd, int) else (pd.forward, pd.backward)

    def resolve_ranks_per_node(self, world_size: int, env: Mapping[str, str] | None = None) -> int:
        """Ranks per node for this world; "auto" reads the launcher's local world size."""
        env = os.environ if env is None else env
        if self.ranks_per_node in ("auto", None):
            local = env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE")
            g = int(local) if local else world_size
        else:
            g = self.ranks_per_node
        if g < 1 or world_size % g != 0:
            raise FSSDPConfigError(f"{SECTION}.ranks_per_node ({self.ranks_per_node!r} -> {g}) must divide the "
                                   f"world size ({world_size})")
        return g

    def resolve_group_size(self, world_size: int, ranks_per_node: int, requested: int | None = None,
                           requested_by: str = "", *, domain: str = "the world size") -> int:
        """Ranks per FSSDP group for this world (``ranks_per_node`` already resolved). ``requested``:
        a group size asked for by the model (``ds_fssdp.MoE(ep_size=N)``, named by ``requested_by``);
        it must agree with ``fssdp.group_size`` when both are given. ``domain``: what
        ``world_size`` counts (under pipeline parallelism a stage's data-parallel ranks)."""
        g = self.group_size
        if requested is not None:
            if g is not None and g != requested:
                raise FSSDPConfigError(f"{SECTION}.group_size ({g}) conflicts with {requested_by} ({requested}); "
                                       "give one of them, or the same value")
            g = requested
        if g is None:
            return world_size
        name = f"{SECTION}.group_size ({g})" if requested is None else f"{requested_by} ({g})"
        if g < 1 or world_size % g:
            raise FSSDPConfigError(f"{name} must divide {domain} ({world_size})")
        if g % ranks_per_node and ranks_per_node % g:
            raise FSSDPConfigError(f"{name} must be a multiple or a divisor of {SECTION}.ranks_per_node "
                                   f"({ranks_per_node}): an FSSDP group spans whole nodes or lies inside one")
        return g


def _check_deterministic(cfg: FSSDPConfig) -> None:
    """``deterministic: true`` refuses the knobs whose decisions follow measured timings: they change
    the replicas, hence the summation order, from run to run."""
    if not cfg.deterministic:
        return
    timed = []
    if cfg.overlap_degree == "auto":
        timed.append(f"{SECTION}.overlap_degree (\"auto\"): set an int")
    if cfg.pipeline_degree == "auto" and cfg.hardware is None:
        timed.append(f"{SECTION}.pipeline_degree (\"auto\") without {SECTION}.hardware: set an int or "
                     "{\"forward\": n, \"backward\": n}, or give the hardware")
    if cfg.one_copy_per_destination == "auto" and cfg.hardware is None:
        timed.append(f"{SECTION}.one_copy_per_destination (\"auto\") without {SECTION}.hardware: set true or false, "
                     "or give the hardware")
    if cfg.calibration and cfg.calibration_latency_budget is None:
        timed.append(f"{SECTION}.calibration_latency_budget (None) with calibration: set seconds")
    needs_cost = cfg.calibration or cfg.policy == "fastermoe" or cfg.dispatch == "balanced-time"
    if needs_cost and cfg.hardware is None:
        timed.append(f"{SECTION}.hardware (None) with a cost model (calibration, fastermoe or balanced-time "
                     "dispatch): give flops and bandwidths")
    if timed:
        raise FSSDPConfigError(f"{SECTION}.deterministic (true) refuses decisions taken from measured timings: " +
                               "; ".join(timed))


def _format_errors(err: ValidationError, section: Mapping[str, Any]) -> str:
    known = ", ".join(FSSDPConfig.model_fields)
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("literal[", "int", "float", "bool", "constrained-")))
        key = key or "?"
        value = section.get(key, e.get("input"))
        kind, ctx = e["type"], e.get("ctx", {})
        if key.split(".")[0] == "pipeline_degree":
            value = section.get("pipeline_degree")
            lines.append(f"{SECTION}.pipeline_degree ({value!r}) must be \"auto\", an int >= 1 or "
                         "{\"forward\": n, \"backward\": n} with ints n >= 1")
            key = "pipeline_degree"
        elif key in _AUTO_KEYS:
            lines.append(f"{SECTION}.{key} ({value!r}) must be \"auto\" or an int >= 0")
        elif key == "group_size":
            lines.append(f"{SECTION}.{key} ({value!r}) must be null or an int >= 1")
        elif key == "ranks_per_node":
            lines.append(f"{SECTION}.{key} ({value!r}) must be \"auto\", null or an int >= 1")
        elif kind == "extra_forbidden":
            lines.append(f"{SECTION}.{key} ({value!r}) is not a known key; known keys: {known}")
        elif kind == "greater_than_equal":
            lines.append(f"{SECTION}.{key} ({value!r}) must be >= {ctx['ge']}")
        elif kind == "literal_error":
            lines.append(f"{SECTION}.{key} ({value!r}) must be one of {ctx['expected']}")
        else:
            lines.append(f"{SECTION}.{key} ({value!r}): {e['msg']}")
    unique = {}  # a Union field reports one line per branch; keep the first per key
    for line in lines:
        unique.setdefault(line.split(" ", 1)[0], line)
    return "; ".join(unique.values())
