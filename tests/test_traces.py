"""Routing traces: the file format round-trips (and the shared recorded trace loads), the
synthetic generator hits its target skew, the re-mapper keeps per-rank totals and expert shares,
and the load-prediction R^2 matches the runtime's predictor."""
import json
import os

import numpy as np
import pytest
import torch

from ds_fssdp.planner import LoadPredictor
from ds_fssdp.sim.prediction import predicted_loads, prediction_r2
from ds_fssdp.sim.remap import remap_trace
from ds_fssdp.sim.synth import synthetic_trace
from ds_fssdp.sim.traces import Trace, TraceWriter, load_trace, save_trace, share_std

SHARED = "/work/shared/data/trace_e8.npz"


def test_writer_round_trip_and_atomic_files(tmp_path):
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 100, size=(3, 4, 2)) for _ in range(7)]
    path = str(tmp_path / "run" / "trace.npz")
    with TraceWriter(path, meta={"top_k": 2, "note": "test"}, flush_every=3) as w:
        for i, tokens in enumerate(steps):
            w.append(torch.from_numpy(tokens) if i % 2 else tokens, loss=1.0 / (i + 1))
            if i == 3:  # flushed after 3 appends: a complete trace of 3 steps is already on disk
                assert load_trace(path).steps == 3
    trace = load_trace(path)
    assert trace.tokens_SLED.dtype == np.int32 and trace.tokens_SLED.shape == (7, 3, 4, 2)
    assert np.array_equal(trace.tokens_SLED, np.stack(steps))
    assert np.allclose(trace.arrays["loss"], [1.0 / (i + 1) for i in range(7)])
    assert trace.top_k == 2 and trace.meta["note"] == "test"
    assert trace.meta["format"] == "ds-fssdp-trace" and trace.meta["num_experts"] == 4
    with open(str(tmp_path / "run" / "trace.json")) as f:
        assert json.load(f)["steps"] == 7
    assert sorted(os.listdir(tmp_path / "run")) == ["trace.json", "trace.npz"], "no temporary files left behind"
    # save_trace / load_trace without the writer, and slicing.
    save_trace(str(tmp_path / "b"), trace.slice(2, 3))
    again = load_trace(str(tmp_path / "b.npz"))
    assert np.array_equal(again.tokens_SLED, trace.tokens_SLED[2:5]) and np.allclose(again.arrays["loss"],
                                                                                     trace.arrays["loss"][2:5])


def test_writer_and_loader_errors(tmp_path):
    w = TraceWriter(str(tmp_path / "t.npz"))
    w.append(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"\(2, 3, 5\) differs"):
        w.append(np.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="must be \\[layers, experts, ranks\\]"):
        w.append(np.zeros((3, 4)))
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_trace(str(tmp_path / "nope.npz"))
    with pytest.raises(ValueError, match="shape"):
        Trace(np.zeros((2, 3), dtype=np.int32))


@pytest.mark.skipif(not os.path.exists(SHARED), reason="shared recorded trace not present")
def test_shared_recorded_trace_loads_and_predicts():
    trace = load_trace(SHARED)
    assert trace.tokens_SLED.shape == (1024, 4, 8, 8) and trace.top_k == 2
    assert int(trace.tokens_SLED[0, 0].sum()) == 4096 * 2  # one layer: tokens per step x top-k
    r2 = prediction_r2(trace.load_SLE(), 5)
    assert 0.88 < r2 < 0.92, r2  # its README: 0.90


def test_r2_uses_the_runtime_predictor():
    rng = np.random.default_rng(1)
    load = rng.integers(0, 50, size=(12, 2, 5)).astype(np.float64)
    pred = predicted_loads(load, 3)
    predictor = LoadPredictor([5, 5], window=3)
    for s in range(12):
        for l in range(2):
            if s >= 3:
                assert np.allclose(predictor.predict(l).numpy(), pred[s - 3, l])
            predictor.observe(l, torch.from_numpy(load[s, l]))
    assert prediction_r2(np.tile(load[:1], (10, 1, 1)), 3) == 1.0  # constant loads are predicted exactly
    assert prediction_r2(load, 3) < 0.5  # i.i.d. noise is not


@pytest.mark.parametrize("target", [0.034, 0.046])
def test_synthetic_trace_hits_its_target_skew(target):
    trace = synthetic_trace(steps=60, num_layers=2, num_experts=32, num_ranks=8, assignments_per_rank=4000,
                            target_std=target, top_k=2, seed=1)
    assert trace.tokens_SLED.shape == (60, 2, 32, 8)
    assert np.all(trace.tokens_SLED.sum(2) == 4000), "every rank dispatches its assignments"
    assert abs(trace.share_std() - target) < 0.1 * target
    assert prediction_r2(trace.load_SLE(), 5) > 0.8, "drift slow enough for the predictor"
    per_rank_share = trace.tokens_SLED / 4000
    assert per_rank_share.max() < 0.5 + 0.03, "top-2: no expert takes more than half a rank's assignments"
    same = synthetic_trace(steps=60, num_layers=2, num_experts=32, num_ranks=8, assignments_per_rank=4000,
                           target_std=target, top_k=2, seed=1)
    assert np.array_equal(same.tokens_SLED, trace.tokens_SLED), "seeded"
    with pytest.raises(ValueError, match=r"target_std \(0.9\)"):
        synthetic_trace(steps=5, num_layers=1, num_experts=8, num_ranks=2, assignments_per_rank=10, target_std=0.9)


def test_remap_to_more_ranks_experts_layers():
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.full(4, 0.5), size=(30, 2))  # [S, L, E]
    tokens = np.stack([[rng.multinomial(500, probs[s, l], size=3).T for l in range(2)] for s in range(30)])
    src = Trace(tokens.astype(np.int32), {"top_k": 2})
    out = remap_trace(src, num_ranks=12, assignments_per_rank=20000, num_experts=8, num_layers=5, seed=3)
    assert out.tokens_SLED.shape == (30, 5, 8, 12) and out.top_k == 2
    assert np.all(out.tokens_SLED.sum(2) == 20000), "each rank gets the model's assignments"
    # Layer 0 replays source layer 0: each source expert's share survives, split into two experts.
    perm = np.zeros(8, dtype=int)
    src_share = src.load_SLE()[:, 0] / src.load_SLE()[:, 0].sum(1, keepdims=True)
    out_share = out.load_SLE()[:, 0] / out.load_SLE()[:, 0].sum(1, keepdims=True)
    # Recover the sibling pairs by matching shares at every step: siblings carry equal halves.
    for e in range(4):
        diffs = np.abs(out_share - src_share[:, e:e + 1] / 2).mean(0)
        perm[np.argsort(diffs)[:2]] = e
    for e in range(4):
        assert np.abs(out_share[:, perm == e].sum(1) - src_share[:, e]).max() < 0.02
    assert abs(out.share_std() - src.share_std() / 2) < 0.02, "the skew measure divides by the split factor"
    again = remap_trace(src, num_ranks=12, assignments_per_rank=20000, num_experts=8, num_layers=5, seed=3)
    assert np.array_equal(again.tokens_SLED, out.tokens_SLED)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be a multiple"):
        remap_trace(src, num_ranks=4, assignments_per_rank=10, num_experts=6)


def test_share_std_of_known_loads():
    load = np.array([[[1.0, 1, 1, 1], [4, 0, 0, 0]]])
    assert share_std(load) == pytest.approx((0.0 + np.std([1, 0, 0, 0])) / 2)
