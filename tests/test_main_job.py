"""The README's main job, through the real deepspeed launcher on 2 CPU ranks (short runs, tiny model):
its run directory, and the comparison with EP in two commands."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from distributed import free_port

from ds_fssdp.report.figures import read_metrics
from ds_fssdp.report.replay import replay
from ds_fssdp.sim.traces import load_trace

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, LAYERS = 25, 2
TINY = ["--steps", str(STEPS), "--seq-len", "32", "--d-model", "32", "--layers", str(LAYERS), "--ffn-hidden", "64"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def launch(*args, cwd):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), os.path.join(REPO, "examples",
                                                                                       "train_gpt_moe.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_main_job_trains_and_fills_its_run_directory_then_compares_with_ep(tmp_path):
    proc = launch(*TINY, cwd=tmp_path)  # default run directory: runs/gpt_moe_fssdp under the working directory
    run = tmp_path / "runs" / "gpt_moe_fssdp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["policy"] == "fssdp" and summary["ranks"] == 2 and summary["steps"] == STEPS
    assert summary["nodes"] == 1
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert len(summary["layers"]) == LAYERS
    assert any(layer["replicas"] > 0 for layer in summary["layers"]), "no replica was ever placed"
    assert "tokens/s" in proc.stdout and "straggler" in proc.stdout and "gathered MB" in proc.stdout

    for name in ("load_heatmap.png", "placement.png", "metrics.png"):
        data = (run / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    metrics = read_metrics(str(run / "metrics.csv"))
    assert list(metrics["step"]) == list(range(1, STEPS + 1))
    for l in range(LAYERS):
        assert np.all(metrics[f"layer{l}/straggler"] >= 1.0)
        assert np.all(metrics[f"layer{l}/ep_straggler"] >= 1.0)
    trace = load_trace(str(run / "trace.npz"))
    assert trace.tokens_SLED.shape[:2] == (STEPS, LAYERS) and trace.arrays["loss"].shape == (STEPS, )
    # The placement picture replays the planner from the trace: it must agree with what the
    # runtime did, step by step (replicas and straggler factor of every layer).
    rep = replay(trace)
    for l in range(LAYERS):
        np.testing.assert_array_equal(rep.replicas_SL()[:, l], metrics[f"layer{l}/replicas"])
        np.testing.assert_allclose(rep.straggler_SL()[:, l], metrics[f"layer{l}/straggler"], rtol=1e-9)
    # and every recorded decision is the one derived from the trace's inputs (the offline check)
    check = subprocess.run([sys.executable, "-m", "ds_fssdp.report", str(run), "--check"], capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0 and f"{STEPS} iterations x {LAYERS} layers" in check.stdout, check.stdout + check.stderr

    proc = launch(*TINY, "--policy", "ep", "--no-report", cwd=tmp_path)
    ep_run = tmp_path / "runs" / "gpt_moe_ep"
    ep = json.loads((ep_run / "summary.json").read_text())
    assert ep["policy"] == "ep" and all(layer["replicas"] == 0 for layer in ep["layers"])
    ep_metrics = read_metrics(str(ep_run / "metrics.csv"))
    for l in range(LAYERS):
        np.testing.assert_array_equal(ep_metrics[f"layer{l}/straggler"], ep_metrics[f"layer{l}/ep_straggler"])
    # The second command's table ends with both runs side by side.
    tail = proc.stdout[proc.stdout.index("vs this"):]
    assert "runs/gpt_moe_ep" in tail and "runs/gpt_moe_fssdp" in tail, tail
