"""The layer's exchange priced in C (``_fastplan.exchange_shares`` / ``exchange_price``, under
concurrent costs) is :func:`ds_fssdp.planner.onecopy.price_exchange`'s Python reference bit for bit:
the degrees, the one-copy choice, every rank's loads and seconds, the rows one copy sends and its
two hops' rows per link, on random exchanges with zeros (empty rows, a rank that sends nothing),
one node, one rank per node and several nodes, at every one-copy setting, fixed or chosen degrees,
with side work or without."""
import numpy as np
import pytest

from ds_fssdp.planner import onecopy
from ds_fssdp.planner.schedule import Linear, ScheduleCosts

FIELDS = ("degrees", "one_copy", "load_cols", "forward_R", "backward_R", "sent_DD", "routed")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, float, int)):
        return type(a) is type(b) and a == b
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _costs(rng) -> ScheduleCosts:
    return ScheduleCosts(a2a_intra=Linear(*rng.uniform([0, 1e-12], [3e-5, 1e-9])),
                         a2a_inter=Linear(*rng.uniform([0, 1e-12], [3e-5, 1e-8])),
                         gemm=Linear(*rng.uniform([0, 1e-10], [1e-5, 1e-7])), backward_factor=rng.uniform(1, 3))


def _traffic(rng, D: int, trial: int) -> np.ndarray:
    t = rng.integers(0, 3000, (D, D)).astype(np.float64)
    if trial % 3 == 0:
        t[rng.random((D, D)) < 0.6] = 0.0  # sparse: destinations with nothing, whole zero blocks
    if trial % 5 == 0:
        t[rng.integers(D)] = 0.0  # a rank that sends nothing (its shares' masked division)
    if trial % 7 == 0:
        t *= rng.random((D, D))  # fractions, not only counts
    if trial % 11 == 0:
        t[:] = 0.0  # nothing at all
    return t


class _Counted:
    """The C module, counting its exchange_price calls (so a test sees the C ran)."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __getattr__(self, name):
        if name == "exchange_price":
            self.calls += 1
        return getattr(self.module, name)


# (ranks per node, nodes): one node, one rank per node, several nodes; rows of 8 and more (numpy's
# pairwise sums: 8 accumulators from 8, split past 128)
SHAPES = [(1, 1), (4, 1), (1, 5), (2, 2), (3, 4), (8, 2), (8, 8), (4, 9), (16, 10), (8, 24)]


@pytest.mark.parametrize("G,n", SHAPES)
def test_price_exchange_in_c_is_the_python_reference(G, n, monkeypatch):
    if onecopy._fastplan is None:
        pytest.skip("the planner's C extension is not built")
    rng = np.random.default_rng(G * 100 + n)
    D = G * n
    counted = _Counted(onecopy._fastplan)
    monkeypatch.setattr(onecopy, "_fastplan", counted)
    for trial in range(24 if D <= 64 else 6):
        kw = dict(ranks_per_node=G, token_bytes=float(rng.choice([14336.0, 4096.0])),
                  top_k=int(rng.choice([1, 2, 4, 6, 8])), weight_bytes=2.0,
                  one_copy=[True, False, "auto"][trial % 3], relay=bool(trial % 2),
                  degrees=None if trial % 4 else (int(rng.integers(1, 5)), int(rng.integers(1, 5))),
                  side_ratio=float(rng.choice([0.0, 0.5, 1.7])))
        costs, traffic = _costs(rng), _traffic(rng, D, trial)
        calls = counted.calls
        got = onecopy.price_exchange(costs, traffic, **kw)
        assert counted.calls > calls
        with monkeypatch.context() as m:
            m.setattr(onecopy, "_fastplan", None)
            want = onecopy.price_exchange(costs, traffic, **kw)
        for f in FIELDS:
            assert _same(getattr(got, f), getattr(want, f)), (f, trial, kw)
        if kw["relay"] and want.one_copy and n > 1 and G > 1:
            assert got.routed is not None  # the two hops were priced, not skipped


def test_c_takes_the_python_paths_refusals(monkeypatch):
    """Inputs the C does not price (ranks per node not dividing the ranks, a degree below 1) go to
    the Python reference, which raises as before; a negative side ratio raises either way."""
    costs = _costs(np.random.default_rng(0))
    traffic = np.ones((6, 6))
    kw = dict(token_bytes=4.0, top_k=2, weight_bytes=2.0, one_copy="auto", relay=True)
    with pytest.raises(ValueError, match="ranks_per_node"):
        onecopy.price_exchange(costs, traffic, ranks_per_node=4, **kw)
    with pytest.raises(ValueError, match="pipeline degree"):
        onecopy.price_exchange(costs, traffic, ranks_per_node=3, degrees=(0, 1), **kw)
    for fast in (onecopy._fastplan, None):
        with monkeypatch.context() as m:
            m.setattr(onecopy, "_fastplan", fast)
            with pytest.raises(ValueError, match="side_ratio"):
                onecopy.price_exchange(costs, traffic, ranks_per_node=3, side_ratio=-1.0, **kw)
