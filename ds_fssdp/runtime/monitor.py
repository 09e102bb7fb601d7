"""Per-step FSSDP metrics: a CSV file by default, and DeepSpeed's monitor (TensorBoard, W&B, CSV,
Comet) whenever the DeepSpeed config enables one. What each metric means, the CSV's columns and the
monitor's event names: docs/observability.md, "Per-step metrics".

Legend: L MoE layers.

After every optimizer step rank 0 writes every MoE layer's values of its last training iteration
(:data:`LAYER_METRICS`) and the step's (:data:`STEP_METRICS`). Under pipeline parallelism each
stage's first rank sends its layers' values to rank 0 at the step, and a layer's ``l`` is its index
among all stages' MoE layers.
"""
from __future__ import annotations

import atexit
import csv
import math
import os

from deepspeed import comm as dist
from deepspeed.utils import logger

# Per MoE layer, from ``FSSDPMoE.last_stats`` (ShardedExperts.stats).
LAYER_METRICS = (
    "straggler",  # max / mean rows computed per rank
    "ep_straggler",  # the same for the shard placement alone (what static EP would have had)
    "replicas",  # replica (expert, rank) pairs beyond the shard
    "evicted_replicas",  # ... gathered under the attention and dropped by calibration (not reduced)
    "gather_bytes",  # SparseAllGather, group total
    "gather_bytes_inter",  # ... of which crossed nodes
    "reduce_bytes",  # SparseReduceScatter, group total
    "a2a_bytes_intra",  # token dispatch + combine inside nodes
    "a2a_bytes_inter",  # ... across nodes
    "a2a_bytes_saved",  # ... of those (one row per assignment), not sent: one copy per destination
    "a2a_bytes_saved_inter",  # ... of which across nodes (relays: one copy per destination node)
    "a2a_meta_bytes",  # the routing entries (slots, weights) sent instead
    "gather_exposed_s",  # rank 0's wait for the replicas (not hidden behind the attention)
    "reduce_exposed_s",  # rank 0's wait for the reduced gradients after the backward
    "edp_gather_wait_s",  # ... for the layer's EDP all-gather left in flight by the last step (0: synchronous)
    "load_prediction_error",  # sum |predicted - actual| / sum actual over experts (NaN at first)
    "overlap_degree",  # t in force (varies with "auto")
    "pipeline_degree_fwd",  # chunks of the forward token exchange (moe/pipeline.py; 1: unchunked)
    "pipeline_degree_bwd",  # ... of the backward's
)
# Per optimizer step, from ``FSSDPStage.last_step``.
STEP_METRICS = ("global_grad_norm", "replica_bytes_peak", "reshard_bytes_sent", "cost_fit_error")


class StageMonitor:
    """Writes the metrics of every optimizer step on rank 0; a no-op on other ranks."""

    def __init__(self, num_layers: int, *, csv_path: str | None, ds_monitor=None, rank: int = 0):
        self.num_layers = num_layers
        self.rank = rank
        self.active = bool(csv_path) or ds_monitor is not None  # rank 0 writes somewhere (the same on every rank)
        self.ds_monitor = ds_monitor if rank == 0 else None
        self.csv_path = csv_path if rank == 0 else None
        self.columns = (["step", "samples"] +
                        [f"layer{l}/{m}" for l in range(num_layers) for m in LAYER_METRICS] + list(STEP_METRICS))
        self._file = self._writer = None
        if self.csv_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.csv_path)), exist_ok=True)
            self._file = open(self.csv_path, "w", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file)
            self._writer.writerow(self.columns)
            self._file.flush()
            atexit.register(self.close)

    @classmethod
    def for_engine(cls, stage, engine) -> "StageMonitor":
        """The stage's config decides the CSV; the engine's ``monitor`` the DeepSpeed backends."""
        rank = dist.get_rank()
        ds_monitor = getattr(engine, "monitor", None)
        if ds_monitor is not None and not ds_monitor.enabled:
            ds_monitor = None
        monitor = cls(getattr(stage, "num_global_layers", len(stage.layers)), csv_path=stage.config.metrics_csv,
                      ds_monitor=ds_monitor, rank=rank)
        if rank == 0:
            where = [f"CSV {os.path.abspath(monitor.csv_path)}"] if monitor.csv_path else []
            where += ["DeepSpeed's monitor"] if ds_monitor is not None else []
            none = "nowhere (fssdp.metrics_csv is null and no DeepSpeed monitor is enabled)"
            logger.info(f"fssdp: per-step metrics -> {' and '.join(where) or none}")
        return monitor

    def values(self, stage) -> dict:
        """This step's metrics by name (``layer{l}/{metric}``, ``l`` the layer's index among all
        pipeline stages' MoE layers, and the step metrics)."""
        out = {}
        indices = getattr(stage, "global_layers", None) or range(len(stage.layers))
        for l, layer in zip(indices, stage.layers):
            stats = layer.last_stats
            for m in LAYER_METRICS:
                out[f"layer{l}/{m}"] = _number(stats.get(m))
        for m in STEP_METRICS:
            out[m] = _number(stage.last_step.get(m))
        return out

    def after_step(self, engine) -> None:
        stage = engine.fssdp
        if getattr(stage, "layout", None) is not None:  # pipeline stages: every stage's layers to rank 0
            return self._after_pipeline_step(engine)
        if self.rank != 0 or (self._writer is None and self.ds_monitor is None):
            return
        self._write(engine, self.values(stage))

    def _after_pipeline_step(self, engine) -> None:
        """Each stage's first rank (pipeline 0: ranks 0, dp, 2 dp, ...) sends its layers' values to
        rank 0 over their pipe group (collective over it); the step metrics are rank 0's."""
        stage = engine.fssdp
        if not self.active or stage.layout.stages[stage.layout.stage_id][0] != self.rank:
            return
        parts = [None] * stage.layout.num_stages
        dist.all_gather_object(parts, self.values(stage), group=stage.layout.pipe_group)
        if self.rank != 0:
            return
        values = dict(parts[0])
        for part in parts[1:]:
            values.update({k: v for k, v in part.items() if k.startswith("layer")})
        self._write(engine, values)

    def _write(self, engine, values: dict) -> None:
        if self._writer is not None:
            self._writer.writerow([engine.global_steps, engine.global_samples] + [values[c] for c in self.columns[2:]])
            self._file.flush()
        if self.ds_monitor is not None:
            self.ds_monitor.write_events([(f"FSSDP/{name}", value, engine.global_samples)
                                          for name, value in values.items() if not math.isnan(value)])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None


def _number(value) -> float | int:
    """A number for the CSV and the monitors: tensors become Python numbers, counts stay ints,
    missing values are NaN."""
    if value is None:
        return float("nan")
    if hasattr(value, "item"):
        value = value.item()
    return value if isinstance(value, int) and not isinstance(value, bool) else float(value)
