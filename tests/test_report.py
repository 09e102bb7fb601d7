"""``python -m ds_fssdp.report``: the PNGs show the trace (read back pixel by pixel)."""
import dataclasses
import os
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from ds_fssdp import Topology
from ds_fssdp.report import render
from ds_fssdp.sim.traces import Trace, save_trace

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, E, D = 30, 4, 2
ASSIGN = 400  # assignments per rank per iteration (tokens x top-k)
HOT, HOT_SHARE, COLD_SHARE = 2, 0.55, 0.15
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def hot_expert_trace() -> Trace:
    """Layer 0: expert 2 takes 55% of every rank's assignments; layer 1: uniform."""
    tokens = np.zeros((S, 2, E, D), dtype=np.int32)
    tokens[:, 0, :, :] = int(COLD_SHARE * ASSIGN)
    tokens[:, 0, HOT, :] = int(HOT_SHARE * ASSIGN)
    tokens[:, 1, :, :] = ASSIGN // E
    meta = {"top_k": 2, "policy": "fssdp", "materialization_budget": 2, "overlap_degree": 4, "load_window": 5,
            "ranks_per_node": 2, "placement": "joint", "dispatch": "balanced"}
    return Trace(tokens, meta, {"loss": np.linspace(5, 3, S, dtype=np.float32)})


@pytest.fixture
def run_dir(tmp_path):
    save_trace(str(tmp_path / "trace.npz"), hot_expert_trace())
    return tmp_path


def _color_at(img, x, y):
    return img[int(round(y)), int(round(x)), :3]


def _invert(cmap_name, rgb, vmin, vmax):
    """The value a colormap color stands for (nearest of 256 entries)."""
    lut = matplotlib.colormaps[cmap_name](np.linspace(0, 1, 256))[:, :3]
    i = int(np.argmin(((lut - rgb)**2).sum(1)))
    return vmin + (vmax - vmin) * i / 255, float(((lut[i] - rgb)**2).sum())


def test_heatmap_pixels_show_the_hot_expert(run_dir):
    result = render(str(run_dir))
    img = imread(os.path.join(run_dir, "load_heatmap.png"))
    heat = result["heatmap"]
    expected = {0: [COLD_SHARE] * E, 1: [0.25] * E}
    expected[0][HOT] = HOT_SHARE
    for layer, (x0, y0, x1, y1) in enumerate(heat["axes_px"]):
        for e in range(E):
            y = y1 - (e + 0.5) * (y1 - y0) / E  # expert 0 at the bottom
            colors = [_color_at(img, x0 + f * (x1 - x0), y) for f in (0.1, 0.5, 0.9)]
            for rgb in colors:
                value, dist = _invert(heat["cmap"], rgb, heat["vmin"], heat["vmax"])
                assert dist < 1e-3, f"layer {layer} expert {e}: pixel {rgb} is not a heatmap color"
                assert value == pytest.approx(expected[layer][e], abs=0.01), (layer, e, value)


def test_placement_pixels_show_owners_and_the_hot_replica(run_dir):
    result = render(str(run_dir))
    place = result["placement"]
    freq = place["replica_frequency_LED"]
    # The planner replicates the hot expert (owned by rank 1) on rank 0 from the second iteration on.
    assert freq[0, HOT, 0] == pytest.approx((S - 1) / S)
    assert freq[0].max() == freq[0, HOT, 0]
    rep = result["replay"]
    assert rep.ep_straggler_SL()[1:, 0].mean() == pytest.approx(560 / 400)
    assert rep.straggler_SL()[1:, 0].max() < 1.05
    img = imread(os.path.join(run_dir, "placement.png"))
    owner = np.array(to_rgb(place["owner_color"]))
    cmap = matplotlib.colormaps[place["cmap"]]
    for layer, (x0, y0, x1, y1) in enumerate(place["axes_px"]):
        for e in range(E):
            for d in range(D):
                # Off the cell's centre, where its percentage is written.
                x = x0 + (d + 0.12) * (x1 - x0) / D
                y = y0 + (e + 0.5) * (y1 - y0) / E  # expert 0 on top
                rgb = _color_at(img, x, y)
                want = owner if place["owner_E"][e] == d else np.array(cmap(freq[layer, e, d])[:3])
                assert np.abs(rgb - want).max() < 0.02, (layer, e, d, rgb, want)


def test_cli_writes_nonempty_pngs(run_dir):
    proc = subprocess.run([sys.executable, "-m", "ds_fssdp.report", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("load_heatmap.png", "placement.png"):
        data = (run_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
        assert f"wrote {run_dir / name}" in proc.stdout
    assert "straggler EP -> placement: 1.40->" in proc.stdout, proc.stdout
    assert not (run_dir / "metrics.png").exists()  # no metrics CSV in this run directory


def test_cli_refuses_a_directory_without_one_trace(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ds_fssdp.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "holds 0 traces" in proc.stderr, proc.stderr[-2000:]


def test_replay_of_a_removed_cost_placement_plans_joint_and_says_so():
    """placement "cost" left the runtime: a trace recorded with it replays as "joint" (the same
    LayerPlanner call as the runtime's), with a note."""
    from ds_fssdp.planner import LoadPredictor, place
    from ds_fssdp.planner.shard import homogeneous_owner
    from ds_fssdp.report.replay import replay
    trace = hot_expert_trace()
    trace.meta.update(placement="cost")
    r = replay(trace)
    assert r.settings.placement == "joint" and any("'cost'" in n for n in r.notes)
    topo = Topology(num_ranks=D, ranks_per_node=2)
    predictor = LoadPredictor([E] * 2, window=5)
    owner = homogeneous_owner(E, D)
    tokens = torch.from_numpy(trace.tokens_SLED.astype(np.int64))
    for s in range(S):
        predicted = predictor.predict_tokens(0)
        want = place(owner, predicted, topo, placement="joint", overlap_degree=4, budget=2)
        assert np.array_equal(r.held_SLED[s, 0], want.numpy())
        predictor.observe(0, tokens[s, 0])
    assert r.replicas_SL()[5:, 0].max() >= 1  # the hot expert gets a replica


def test_check_refuses_a_trace_without_the_runtime_record(run_dir):
    """A trace not written by the runtime (routing counts only) has nothing to check against: exit 2,
    naming what it lacks (never a pass)."""
    proc = subprocess.run([sys.executable, "-m", "ds_fssdp.report", str(run_dir), "--check"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "decision_owner" in proc.stderr and "optimizer_step" in proc.stderr, proc.stderr


def test_first_difference_is_the_earliest_iteration_then_layer_then_array():
    from ds_fssdp.report.check import first_difference
    order = ["decision_owner", "decision_t", "decision_held"]
    diffs = [("decision_held", 3, 0), ("decision_t", 3, 0), ("decision_owner", 3, 1), ("decision_owner", 5, 0)]
    assert first_difference(diffs, order) == (3, 0, "decision_t")
    assert first_difference([], order) is None
