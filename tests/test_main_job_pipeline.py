"""The main job with --pipeline-stages, through the deepspeed launcher on 4 CPU ranks: 3 MoE layers
on 2 stages (uneven), the same global batches as the run without pipelining, so the same losses."""
import json
import os
import subprocess
import sys

import pytest

from distributed import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # launches processes; > 30 s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
TINY = ["--steps", str(STEPS), "--seq-len", "32", "--d-model", "32", "--layers", "3", "--ffn-hidden", "64",
        "--no-report"]


def launch(*args, cwd):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()),
           os.path.join(REPO, "examples", "train_gpt_moe.py"), *TINY, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(run) -> list:
    return [json.loads(line)["loss"] for line in (run / "losses.jsonl").read_text().splitlines()]


def test_pipeline_stages_train_like_the_run_without_them(tmp_path):
    launch("--out", "runs/plain", cwd=tmp_path)
    launch("--out", "runs/pp", "--pipeline-stages", "2", cwd=tmp_path)
    plain, pp = tmp_path / "runs" / "plain", tmp_path / "runs" / "pp"
    # fp32: only the summation order differs (another placement, another gradient accumulation)
    assert _losses(pp) == pytest.approx(_losses(plain), rel=2e-6)
    assert len(_losses(pp)) == STEPS
    summary, base = (json.loads((run / "summary.json").read_text()) for run in (pp, plain))
    assert summary["pipeline_stages"] == 2 and base["pipeline_stages"] == 1
    assert summary["ranks"] == 4 and len(summary["layers"]) == 3  # every stage's layers in the table
    assert any(layer["replicas"] > 0 for layer in summary["layers"])
    assert summary["val_loss"] == pytest.approx(base["val_loss"], rel=2e-6)
    # every stage's layers in the metrics CSV (rank 0's, gathered from each stage's first rank) and
    # each stage's own trace
    header = (pp / "metrics.csv").read_text().splitlines()[0].split(",")
    assert [c for c in header if c.endswith("/straggler")] == [f"layer{g}/straggler" for g in range(3)]
    from ds_fssdp.sim.traces import load_trace
    first, second = load_trace(str(pp / "trace.npz")), load_trace(str(pp / "trace.stage1.npz"))
    assert first.meta["global_layers"] == [0, 1] and second.meta["global_layers"] == [2]
    assert first.tokens_SLED.shape[1] == 2 and second.tokens_SLED.shape[1] == 1
