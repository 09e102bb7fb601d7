"""The synthetic trace's sampling in C (``_fastplan.systematic_counts``, through
:func:`ds_fssdp.sim.loadcv.step_counts`) is the numpy reference's, count for count: the
transposed :func:`~ds_fssdp.sim.loadcv.systematic_counts` with the same rng draw, on capped
softmax shares and on edge cases (one expert holding everything, zero shares, one rank, one layer,
rank counts that are not a multiple of the C's row block), and whole traces are equal."""
import numpy as np
import pytest

from ds_fssdp.sim import loadcv
from ds_fssdp.sim.synth import _cap, _softmax


def _shares(rng, L: int, D: int, E: int, case: int) -> np.ndarray:
    x = (rng.standard_normal((L, D, E)) * rng.uniform(0.1, 4.0)).astype(np.float32)
    p = _cap(_softmax(x, out=x), 1.0 / rng.choice([1, 2, 8]), out=x)
    if case == 1:
        p[..., 1:] = 0.0  # one expert takes everything
        p[..., 0] = 1.0
    if case == 2:
        p[p < np.quantile(p, 0.5)] = 0.0  # many zero shares
    return p


@pytest.mark.parametrize("L,D,E", [(1, 1, 2), (2, 5, 3), (3, 17, 8), (2, 40, 64), (1, 33, 256)])
def test_step_counts_in_c_are_the_numpy_reference(L, D, E, monkeypatch):
    if loadcv._fastplan is None:
        pytest.skip("the planner's C extension is not built")
    for case in range(3):
        seed = [L, D, E, case]
        p = _shares(np.random.default_rng(seed), L, D, E, case)
        n = int(np.random.default_rng(seed).integers(1, 5000))
        got = loadcv.step_counts(p, n, np.random.default_rng(seed))
        with monkeypatch.context() as m:
            m.setattr(loadcv, "_fastplan", None)
            want = loadcv.step_counts(p, n, np.random.default_rng(seed))
        assert got.dtype == want.dtype == np.int32 and got.shape == (L, E, D)
        assert np.array_equal(got, want), (L, D, E, case)
        assert (got.sum(1) == n).all()  # each rank's counts sum to its assignments


def test_a_synthetic_trace_is_the_same_with_and_without_c(monkeypatch):
    kw = dict(steps=3, num_layers=2, num_experts=16, num_ranks=24, assignments_per_rank=512, cv=0.6, top_k=2)
    got = list(loadcv.LoadCVSource(**kw))
    monkeypatch.setattr(loadcv, "_fastplan", None)
    want = list(loadcv.LoadCVSource(**kw))
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want) == 3
