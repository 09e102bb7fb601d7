"""The planner benchmark scripts README lists still run and write their --json (tiny settings)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_planning_benchmark_runs(tmp_path):
    r = run("planning.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--repeats", "20", "--runs", "2",
            tmp_path=tmp_path)
    assert set(r["results"]) == {"joint+balanced", "paper", "paper+t-by-time", "paper+t-by-serial-time",
                                 "joint_materialize", "balanced_dispatch"}
    assert all(len(v["run_medians_us"]) == 2 and v["median_us"] > 0 for v in r["results"].values())


def test_routing_benchmark_runs(tmp_path):
    r = run("routing.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--tokens", "300", "--repeats", "5",
            tmp_path=tmp_path)
    assert set(r["results"]) == {"route", "route_reference", "moved", "moved_from_table"}
    assert r["reference_over_route"] > 0 and r["table_over_moved"] > 0


def test_hf_models_benchmark_runs(tmp_path):
    """benchmarks/hf_models.py on 2 ranks through the deepspeed launcher, tiny settings: every arm
    reports tokens/s, and the arms train the same math (SGD: equal losses to fp32 rounding)."""
    out = tmp_path / "hf.json"
    subprocess.run(["deepspeed", "--num_gpus", "2", str(ROOT / "benchmarks" / "hf_models.py"), "--families",
                    "qwen3_moe", "--hidden", "32", "--ffn", "32", "--seq-len", "16", "--micro-batch", "2", "--warmup",
                    "1", "--rounds", "1", "--steps", "1", "--json", str(out)], check=True, cwd=ROOT, capture_output=True,
                   timeout=300)
    r = json.loads(out.read_text())["results"]["qwen3_moe"]
    assert set(r) == {"plain", "ep", "fssdp"}
    assert all(a["tokens_per_s"] > 0 and a["max_rel_loss_diff_vs_plain"] < 1e-5 for a in r.values())
    assert r["fssdp"]["straggler"] >= 1.0 and r["plain"]["straggler"] is None


def test_critical_path_benchmark_runs(tmp_path):
    r = run("critical_path.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--tokens", "300", "--repeats", "5",
            "--runs", "2", tmp_path=tmp_path)
    assert set(r["results"]) == {"span", "plan", "route", "expert_order", "span+finish", "stats", "send_rows",
                                 "route_device_on_cpu"}
    assert all(len(v["run_medians_us"]) == 2 and v["median_us"] > 0 for v in r["results"].values())


def test_validate_schedule_benchmark_runs(tmp_path):
    """benchmarks/validate_schedule.py (2 gloo ranks it spawns itself), tiny settings: every arm
    reports a positive predicted and measured per-layer time, and the fit it predicted with."""
    r = run("validate_schedule.py", "--policies", "ep", "--layers", "1", "--d-model", "16", "--ffn-hidden", "32",
            "--seq-len", "8", "--micro-batch", "2", "--warmup", "1", "--steps", "2", "--repeats", "1",
            tmp_path=tmp_path)
    assert set(r["results"]) == {"ep/degree=1", "ep/degree=auto", "ep/degree=(3, 2)"}
    assert all(layer["predicted_ms"] > 0 for v in r["results"].values() for layer in v)
    (layer,) = r["results"]["ep/degree=1"]
    assert layer["measured_ms"] > 0 and layer["predicted_ms"] > 0 and layer["ratio"] > 0
    assert layer["predicted_without_other_ms"] == layer["predicted_ms"]  # EP, one layer: no replica gather
    assert r["fits"]["ep/degree=1"]["schedule_costs"]["gemm"]["startup_s"] >= 0


def test_replica_spans_probe_runs(tmp_path):
    """benchmarks/replica_spans.py, tiny settings: per layer, the gathers and reduces it saw, and
    every replica reduce issued only after its own layer's backward span ended (autograd order, not
    timing: the reason the layer's backward units carry no other bytes)."""
    r = run("replica_spans.py", "--layers", "2", "--d-model", "16", "--ffn-hidden", "32", "--seq-len", "8",
            "--micro-batch", "2", "--warmup", "1", "--steps", "3", "--repeats", "1", tmp_path=tmp_path)
    for rank in ("rank0", "rank1"):
        got = r["probe"][rank]
        assert set(got["collectives"]) == {"gather L0", "gather L1", "reduce L0", "reduce L1"}
        assert set(got["layers"]) == {"L0", "L1"} and got["layers"]["L1"]["other_bytes_last"] == [0.0] * 4
        for layer in ("L0", "L1"):
            issued = {after for (after, _), _n in got["collectives"][f"reduce {layer}"]["issued_after_landed_by"]}
            assert issued == {f"{layer} bwd end"}
    assert set(r["probe"]["span_start_skew"]) == {"L0 fwd start", "L0 bwd start", "L1 fwd start", "L1 bwd start"}


def test_t_by_time_benchmark_runs(tmp_path):
    """benchmarks/t_by_time.py, one small workload: both arms of both FSSDP policies, and the ratio
    it reports is theirs."""
    r = run("t_by_time.py", "--clusters", "a", "--models", "gpt-s-moe", "--gpus", "16", "--steps", "8",
            "--trace", "synthetic", tmp_path=tmp_path)  # a clean clone has no shared trace beside it
    (row, ) = r["rows"]
    for pol in ("fssdp", "fssdp-rm"):
        assert row[f"{pol}_window_ms"] > 0 and row[f"{pol}_time_ms"] > 0
        assert row[f"{pol}_ratio"] == row[f"{pol}_time_ms"] / row[f"{pol}_window_ms"]
    assert r["worst_ratio"] == max(row["fssdp_ratio"], row["fssdp-rm_ratio"])
