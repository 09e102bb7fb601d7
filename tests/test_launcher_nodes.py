"""The real ``deepspeed`` launcher as two nodes on one machine (README: multi-node): a hostfile with
two hosts, one launcher per node with ``--no_ssh --node_rank i`` and a local master address. Each
node's ranks see LOCAL_SIZE = 2, so ``ranks_per_node: "auto"`` makes 2 real nodes of 2 ranks and
the inter-node paths of the sparse collectives and token exchange run."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from distributed import free_port

from ds_fssdp.report.figures import read_metrics
from ds_fssdp.sim.traces import load_trace

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, LAYERS = 12, 2


def test_two_nodes_through_the_deepspeed_launcher(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")  # names only: --no_ssh never resolves them
    run = tmp_path / "run"
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
               "127.0.0.1", "--master_port", port, os.path.join(REPO, "examples", "train_gpt_moe.py"), "--steps",
               str(STEPS), "--seq-len", "32", "--d-model", "32", "--layers", str(LAYERS), "--ffn-hidden", "64",
               "--out", str(run), "--no-report"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node}:\n{out[-4000:]}"

    summary = json.loads((run / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["nodes"] == 2 and summary["ranks_per_node"] == 2, summary
    assert "4 ranks in 2 nodes" in outputs[0]
    assert summary["final_loss"] < summary["first_loss"] - 0.1, summary
    assert load_trace(str(run / "trace.npz")).meta["ranks_per_node"] == 2
    metrics = read_metrics(str(run / "metrics.csv"))
    assert len(metrics["step"]) == STEPS
    inter = sum(metrics[f"layer{l}/gather_bytes_inter"] for l in range(LAYERS))
    assert np.nansum(inter) > 0, "no replica crossed nodes"
    assert all(np.nansum(metrics[f"layer{l}/a2a_bytes_inter"]) > 0 for l in range(LAYERS)), "no token crossed nodes"
