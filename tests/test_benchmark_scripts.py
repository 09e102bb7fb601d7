"""The planner benchmark scripts README lists still run and write their --json (tiny settings)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_planning_benchmark_runs(tmp_path):
    r = run("planning.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--repeats", "20", "--runs", "2",
            tmp_path=tmp_path)
    assert set(r["results"]) == {"joint+balanced", "paper", "joint_materialize", "cost_materialize", "balanced_dispatch"}
    assert all(len(v["run_medians_us"]) == 2 and v["median_us"] > 0 for v in r["results"].values())


def test_routing_benchmark_runs(tmp_path):
    r = run("routing.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--tokens", "300", "--repeats", "5",
            tmp_path=tmp_path)
    assert set(r["results"]) == {"route", "route_reference", "moved", "moved_from_table"}
    assert r["reference_over_route"] > 0 and r["table_over_moved"] > 0


def test_critical_path_benchmark_runs(tmp_path):
    r = run("critical_path.py", "--experts", "16", "--ranks", "8", "--nodes", "2", "--tokens", "300", "--repeats", "5",
            "--runs", "2", tmp_path=tmp_path)
    assert set(r["results"]) == {"span", "plan", "route", "stats", "send_rows", "route_device_on_cpu"}
    assert all(len(v["run_medians_us"]) == 2 and v["median_us"] > 0 for v in r["results"].values())
