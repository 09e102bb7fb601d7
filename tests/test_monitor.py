"""Per-step FSSDP metrics: the CSV by default and DeepSpeed's monitor when configured."""
import copy
import csv
import math
import os
from types import SimpleNamespace

import pytest
import torch

from distributed import spawn
from training import MICRO, MODEL, batch, ds_config

from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.runtime.monitor import LAYER_METRICS, STEP_METRICS, StageMonitor

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

STEPS, GAS, WORLD = 3, 2, 2


class Recorder:
    """Stands in for DeepSpeed's MonitorMaster."""

    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events.extend(events)


def _fake(step: int):
    layers = [SimpleNamespace(last_stats={"straggler": 1.5 + l, "ep_straggler": 2.0, "replicas": 3,
                                          "gather_bytes": 1024, "load_prediction_error": float("nan") if step == 1
                                          else 0.25}) for l in range(2)]
    stage = SimpleNamespace(layers=layers, last_step={"global_grad_norm": torch.tensor(0.5), "replica_bytes_peak": 7})
    return SimpleNamespace(fssdp=stage, global_steps=step, global_samples=8 * step)


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def test_rank0_writes_csv_rows_and_monitor_events(tmp_path):
    path = tmp_path / "sub" / "m.csv"
    rec = Recorder()
    mon = StageMonitor(2, csv_path=str(path), ds_monitor=rec, rank=0)
    for step in (1, 2):
        mon.after_step(_fake(step))
    mon.close()
    header, rows = read_csv(path)
    assert header[:2] == ["step", "samples"]
    assert header[2:2 + len(LAYER_METRICS)] == [f"layer0/{m}" for m in LAYER_METRICS]
    assert header[-len(STEP_METRICS):] == list(STEP_METRICS)
    col = {name: i for i, name in enumerate(header)}
    assert [r[col["step"]] for r in rows] == ["1", "2"] and [r[col["samples"]] for r in rows] == ["8", "16"]
    assert float(rows[0][col["layer1/straggler"]]) == 2.5 and rows[0][col["layer0/replicas"]] == "3"
    assert rows[0][col["layer0/load_prediction_error"]] == "nan" and float(rows[1][col["layer0/load_prediction_error"]]) == 0.25
    assert rows[0][col["layer0/reduce_bytes"]] == "nan"  # a stat the layer did not report
    assert float(rows[1][col["global_grad_norm"]]) == 0.5
    names = {(n, s) for n, _, s in rec.events}
    assert ("FSSDP/layer1/straggler", 16) in names and ("FSSDP/global_grad_norm", 8) in names
    # NaN values are left out of the monitors (TensorBoard/W&B would draw them as gaps or fail).
    assert ("FSSDP/layer0/load_prediction_error", 8) not in names
    assert ("FSSDP/layer0/load_prediction_error", 16) in names


def test_other_ranks_write_nothing(tmp_path):
    rec = Recorder()
    mon = StageMonitor(2, csv_path=str(tmp_path / "m.csv"), ds_monitor=rec, rank=1)
    mon.after_step(_fake(1))
    assert not (tmp_path / "m.csv").exists() and rec.events == []


def test_metrics_csv_config():
    assert FSSDPConfig.from_ds_config({"fssdp": {}}).metrics_csv == "fssdp_metrics.csv"
    assert FSSDPConfig.from_ds_config({"fssdp": {"metrics_csv": None}}).metrics_csv is None
    with pytest.raises(FSSDPConfigError, match="metrics_csv"):
        FSSDPConfig.from_ds_config({"fssdp": {"metrics_csv": 3}})


def _worker(rank, world, tmp):
    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    out = {}
    for name, fssdp in (("default", {"metrics_csv": os.path.join(tmp, "fssdp.csv")}), ("off", {"metrics_csv": None})):
        cfg = ds_config(world=world, gas=GAS, fssdp=fssdp)
        if name == "default":
            cfg["csv_monitor"] = {"enabled": True, "output_path": tmp, "job_name": "job"}
        torch.manual_seed(0)
        model = GPTMoE(MODEL)
        engine, *_ = ds_fssdp.initialize(model=model, config=copy.deepcopy(cfg))
        seen = []
        for step in range(STEPS):
            for micro in range(GAS):
                x, y = batch(step, micro, rank)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            seen.append([{k: l.last_stats.get(k) for k in ("straggler", "replicas", "gather_bytes",
                                                            "load_prediction_error")} for l in model.moe_layers()])
        engine.fssdp_monitor.close()
        out[name] = seen
    return out


def test_engine_writes_metrics_through_csv_and_deepspeed_monitor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a run with metrics_csv null would have written (nothing expected)
    results = spawn(WORLD, _worker, str(tmp_path))
    seen = results[0]["default"]
    header, rows = read_csv(tmp_path / "fssdp.csv")
    col = {name: i for i, name in enumerate(header)}
    assert [int(r[col["step"]]) for r in rows] == list(range(1, STEPS + 1))
    per_step = MICRO * GAS * WORLD
    assert [int(r[col["samples"]]) for r in rows] == [per_step * s for s in range(1, STEPS + 1)]
    for s, row in enumerate(rows):
        for l, stats in enumerate(seen[s]):
            assert float(row[col[f"layer{l}/straggler"]]) == pytest.approx(stats["straggler"])
            assert int(row[col[f"layer{l}/replicas"]]) == stats["replicas"]
            assert int(row[col[f"layer{l}/gather_bytes"]]) == stats["gather_bytes"]
            err = float(row[col[f"layer{l}/load_prediction_error"]])
            # Each step's last micro-step was planned from an earlier one: a finite, bounded error.
            assert math.isfinite(err) and 0.0 <= err <= 2.0 and err == pytest.approx(stats["load_prediction_error"])
    assert any(int(r[col["layer0/replicas"]]) > 0 for r in rows), "no replicas: the metrics show nothing"
    # DeepSpeed's own CSV monitor got the same values, one file per metric, at global_samples.
    ds_header, ds_rows = read_csv(tmp_path / "job" / "FSSDP_layer1_straggler.csv")
    assert ds_header == ["step", "straggler"]
    assert [int(r[0]) for r in ds_rows] == [per_step * s for s in range(1, STEPS + 1)]
    assert [float(r[1]) for r in ds_rows] == pytest.approx([seen[s][1]["straggler"] for s in range(STEPS)])
    assert (tmp_path / "job" / "FSSDP_global_grad_norm.csv").exists()
    assert not (tmp_path / "fssdp_metrics.csv").exists()  # metrics_csv null: no default file
