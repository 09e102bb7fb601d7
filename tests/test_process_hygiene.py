"""What a user's process sees from the library: ``python -m ds_fssdp.sim --json`` prints only the
JSON on stdout, and ``ds_fssdp.initialize`` on CPU does not build DeepSpeed's shared-memory comm
op (training never uses it; its first JIT build takes about 40 s). Both run in fresh processes,
as a user's script would."""
import json
import os
import subprocess
import sys

import pytest

from distributed import free_port

pytestmark = pytest.mark.distributed  # launches processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sim_json_stdout_is_only_json():
    proc = subprocess.run([sys.executable, "-m", "ds_fssdp.sim", "--trace", "synthetic", "--gpus", "8", "--steps", "8",
                           "--policies", "ep,fssdp", "--no-png", "--target-std", "0.08", "--tokens-per-gpu", "4096",
                           "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # the whole of stdout, nothing before or after the document
    assert [r["policy"] for r in out["results"]] == ["ep", "fssdp"]
    # The DeepSpeed import warning still reaches the user, on stderr.
    assert "Setting accelerator to CPU" in proc.stderr


# One rank: a recording build_shm_op stands in for DeepSpeed's (the test's own patch, installed
# before initialize; the library must replace it before DeepSpeed's comm starts).
SHM_SCRIPT = r"""
import sys
import deepspeed, deepspeed.comm.torch  # noqa: F401
calls = []
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: calls.append("built")
import torch
from ds_fssdp import FSSDPMoE, initialize
model = torch.nn.Sequential(FSSDPMoE(hidden_size=8, ffn_hidden_size=12, num_experts=4, k=2))
config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "fssdp": {}}
engine, *_ = initialize(model=model, config=config)
print("SHM_BUILDS", len(calls))
"""


def test_initialize_skips_the_shm_comm_build_on_cpu():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SHM_SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHM_BUILDS 0" in proc.stdout, proc.stdout[-2000:]
