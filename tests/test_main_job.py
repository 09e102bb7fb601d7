"""The README's main job, through the real deepspeed launcher on 2 CPU ranks (a short run)."""
import json
import os
import subprocess
import sys

from distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_trains_through_the_deepspeed_launcher(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), os.path.join(REPO, "examples", "train_gpt_moe.py"),
           "--steps", "25", "--seq-len", "32", "--d-model", "32", "--layers", "2", "--ffn-hidden", "64", "--out",
           str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy"] == "fssdp" and summary["ranks"] == 2 and summary["steps"] == 25
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert len(summary["layers"]) == 2
    assert any(layer["replicas"] > 0 for layer in summary["layers"]), "no replica was ever placed"
    assert "tokens/s" in proc.stdout and "straggler" in proc.stdout
