"""The planner's C paths give exactly what the Python references give (random instances)."""
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import fast, homogeneous_owner
from ds_fssdp.planner.balance import balanced_dispatch, balanced_dispatch_reference
from ds_fssdp.planner.dispatch import dispatch, paper_dispatch_reference
from ds_fssdp.planner.joint import joint_materialize, joint_materialize_reference
from ds_fssdp.planner.materialize import materialize, materialize_reference

SHAPES = [(8, 8, 4), (16, 8, 2), (64, 32, 8), (6, 4, 2), (4, 8, 4), (12, 6, 3), (3, 2, 1), (32, 16, 4), (20, 12, 4),
          (10, 10, 1)]


def test_the_c_extension_is_built():
    assert fast.AVAILABLE, "ds_fssdp.planner._fastplan is missing: reinstall with `pip install -e .`"


def test_c_matches_reference():
    gen = torch.Generator().manual_seed(0)
    for i in range(140):
        E, D, G = SHAPES[i % len(SHAPES)]
        topo = Topology(num_ranks=D, ranks_per_node=G)
        owner = homogeneous_owner(E, D) if i % 2 else torch.randint(0, D, (E, ), generator=gen)
        share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
        # Integer-valued counts: sums are exact in any order, so ties break identically.
        tokens = torch.distributions.Multinomial(total_count=int(torch.randint(1, 3000, (1, ), generator=gen)),
                                                 probs=share).sample((D, )).t().double()
        t = int(torch.randint(0, E + 2, (1, ), generator=gen))
        m = int(torch.randint(0, 7 if i % 4 == 0 else 4, (1, ), generator=gen))  # budgets past every slot too
        want = materialize_reference(owner, tokens.sum(1), topo, overlap_degree=t, budget=m)
        assert torch.equal(materialize(owner, tokens.sum(1), topo, overlap_degree=t, budget=m), want)
        # Calibration's form: extend a placement (random replicas, some ranks past their budget).
        base = torch.rand(E, D, generator=gen) < (0.05, 0.2, 0.5)[i % 3]
        assert torch.equal(materialize(owner, tokens.sum(1), topo, overlap_degree=t, budget=m, base_ED=base),
                           materialize_reference(owner, tokens.sum(1), topo, overlap_degree=t, budget=m, base_ED=base))
        joint = joint_materialize(owner, tokens, topo, overlap_degree=t, budget=m)
        assert torch.equal(joint, joint_materialize_reference(owner, tokens, topo, overlap_degree=t, budget=m))
        T = tokens.long()
        for placement in (want, joint):
            assert torch.equal(dispatch(placement, T, topo), paper_dispatch_reference(placement, T, topo))
            assert torch.equal(balanced_dispatch(placement, T, topo),
                               balanced_dispatch_reference(placement, T, topo))
            slack = (0.0, 0.03, 0.1)[i % 3]
            assert torch.equal(balanced_dispatch(placement, T, topo, slack=slack),
                               balanced_dispatch_reference(placement, T, topo, slack=slack))


def test_compact_plan_equals_the_dense_one(monkeypatch):
    """A compact plan's tables equal the dense plan's sums (traffic_DD in C and in the Python reference)."""
    from ds_fssdp.planner import plan as plan_module
    from ds_fssdp.planner.dispatch import dispatch_plan
    from ds_fssdp.planner.plan import DispatchPlan
    gen = torch.Generator().manual_seed(2)
    for i in range(60):
        E, D, G = SHAPES[i % len(SHAPES)]
        topo = Topology(num_ranks=D, ranks_per_node=G)
        owner = homogeneous_owner(E, D)
        T = torch.distributions.Multinomial(total_count=500, probs=torch.softmax(torch.randn(E, generator=gen), 0)
                                            ).sample((D, )).t().long()
        p = joint_materialize(owner, T.double(), topo, overlap_degree=E, budget=2)
        for mode in ("paper", "balanced"):
            dense = dispatch(p, T, topo, mode=mode, slack=0.03)
            for plan in (dispatch_plan(p, T, topo, mode=mode, slack=0.03), DispatchPlan.from_dense(p, dense)):
                assert torch.equal(plan.dense(), dense)
                assert torch.equal(plan.rows_D(), dense.sum((0, 1)))
                assert torch.equal(plan.traffic_DD(), dense.sum(0))
                with monkeypatch.context() as m:
                    m.setattr(plan_module, "_fastplan", None)
                    assert torch.equal(plan.traffic_DD(), dense.sum(0))
                moved_DD = dense.sum(0).fill_diagonal_(0)
                same_DD = topo.same_node_DD()
                assert plan.moved(G) == (int(moved_DD[same_DD].sum()), int(moved_DD[~same_DD].sum()))
                for r in range(D):
                    assert torch.equal(plan.sent(r), dense[:, r, :])
                    assert torch.equal(plan.received(r), dense[:, :, r])


def test_c_paths_reject_values_that_would_index_out_of_bounds():
    """The C planner reads raw buffers: an owner id outside [0, D) or a negative count is a
    ValueError naming it, never a read or write out of bounds."""
    import pytest
    from ds_fssdp.planner.dispatch import dispatch_plan
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner = homogeneous_owner(8, 4)
    tokens = torch.ones(8, 4, dtype=torch.float64)
    for bad in (4, -1):
        owner_bad = owner.clone()
        owner_bad[3] = bad
        with pytest.raises(ValueError, match=rf"owner_E\[3\] = {bad}"):
            joint_materialize(owner_bad, tokens, topo, overlap_degree=2, budget=1)
        with pytest.raises(ValueError, match=rf"owner_E\[3\] = {bad}"):
            materialize(owner_bad, tokens.sum(1), topo, overlap_degree=2, budget=1)
    placement = joint_materialize(owner, tokens, topo, overlap_degree=2, budget=1)
    T = tokens.long()
    T[5, 2] = -3
    for mode in ("paper", "balanced"):
        with pytest.raises(ValueError, match=r"tokens_ED\[5, 2\] = -3"):
            dispatch_plan(placement, T, topo, mode=mode)
        with pytest.raises(ValueError, match=r"tokens_ED\[5, 2\] = -3"):
            dispatch(placement, T, topo, mode=mode)
    empty = placement.clone()
    empty[6] = False
    with pytest.raises(ValueError, match="expert 6 has none"):
        dispatch_plan(empty, tokens.long(), topo, mode="balanced")


def test_c_paths_take_any_layout_and_dtype():
    """Non-contiguous, other-dtype and numpy inputs are converted, with the same result."""
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    gen = torch.Generator().manual_seed(3)
    T = torch.randint(0, 50, (8, 16), generator=gen).t()  # [E, D], transposed: not contiguous
    want = joint_materialize(owner, T.contiguous().double(), topo, overlap_degree=4, budget=2)
    assert torch.equal(joint_materialize(owner, T.float(), topo, overlap_degree=4, budget=2), want)
    assert torch.equal(joint_materialize(owner.int(), T.double(), topo, overlap_degree=4, budget=2), want)
    from ds_fssdp.planner.dispatch import dispatch_plan
    dense = dispatch(want, T.contiguous(), topo, mode="balanced")
    assert torch.equal(dispatch_plan(want, T, topo, mode="balanced").dense(), dense)
    assert torch.equal(dispatch_plan(want.numpy(), T.numpy(), topo, mode="balanced").dense(), dense)


def test_c_matches_reference_past_64_ranks_and_on_huge_counts():
    """More than 64 ranks and counts near 2^56 (the Hall bound's unpacked base and count) give
    the reference's plans too."""
    gen = torch.Generator().manual_seed(4)
    for E, D, G, scale in ((24, 72, 8, 1), (16, 66, 6, 1), (16, 8, 4, 2 ** 45), (12, 6, 2, 2 ** 47)):
        topo = Topology(num_ranks=D, ranks_per_node=G)
        owner = homogeneous_owner(E, D)
        share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
        T = torch.distributions.Multinomial(total_count=40 * D, probs=share).sample((D, )).t().long() * scale
        for m in (1, 2, 3):
            placement = joint_materialize(owner, T.double(), topo, overlap_degree=8, budget=m)
            assert torch.equal(placement, joint_materialize_reference(owner, T.double(), topo, overlap_degree=8,
                                                                      budget=m))
            assert int((placement.sum(1) > 1).sum()) > 1  # replicated experts: the bound and fill run
            for slack in (0.0, 0.03):
                assert torch.equal(balanced_dispatch(placement, T, topo, slack=slack),
                                   balanced_dispatch_reference(placement, T, topo, slack=slack))
            assert torch.equal(dispatch(placement, T, topo), paper_dispatch_reference(placement, T, topo))


def test_non_finite_predictions_and_a_wrong_topology_are_value_errors():
    import pytest
    from ds_fssdp.planner.dispatch import dispatch_plan
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner = homogeneous_owner(8, 4)
    for bad in (float("nan"), float("inf")):
        tokens = torch.ones(8, 4, dtype=torch.float64)
        tokens[5, 2] = bad
        for fn in (joint_materialize, joint_materialize_reference):
            with pytest.raises(ValueError, match=rf"tokens_ED\[5, 2\] = {bad} is not finite"):
                fn(owner, tokens, topo, overlap_degree=2, budget=1)
    placement = joint_materialize(owner, torch.ones(8, 4, dtype=torch.float64), topo, overlap_degree=2, budget=1)
    with pytest.raises(ValueError, match=r"placement_ED \(8, 4\) on 8 ranks"):
        dispatch_plan(placement, torch.ones(8, 4, dtype=torch.long), Topology(num_ranks=8, ranks_per_node=2),
                      mode="balanced")


def test_a_very_large_layer_frees_its_scratch_and_plans_the_same_again():
    """At 256 ranks the balancing dispatch's scratch passes the size the C planner keeps between
    calls: it is freed and rebuilt (zeroed) for the next call, which plans the same."""
    from ds_fssdp.planner.dispatch import dispatch_plan
    gen = torch.Generator().manual_seed(5)
    E, D = 32, 256
    topo = Topology(num_ranks=D, ranks_per_node=32)
    owner = homogeneous_owner(E, D)
    share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
    T = torch.distributions.Multinomial(total_count=20 * D, probs=share).sample((D, )).t().long()
    placement = joint_materialize(owner, T.double(), topo, overlap_degree=16, budget=1)
    assert int((placement.sum(1) > 1).sum()) == 16  # 16 * 256 * 256 cells: 8 MB of flows, 16 MB of touched list
    want = balanced_dispatch_reference(placement, T, topo, slack=0.03)
    for _ in range(2):
        assert torch.equal(balanced_dispatch(placement, T, topo, slack=0.03), want)
        assert torch.equal(dispatch_plan(placement, T, topo, mode="balanced", slack=0.03).dense(), want)


def test_gather_links_in_c_is_the_reference(monkeypatch):
    """prices.gather_links in C (_fastplan.gather_links) gives the numpy reference's arrays on random
    placements: one group and many, one node and several, relayed or not, a rank per node."""
    import numpy as np

    from ds_fssdp.planner import prices
    rng = np.random.default_rng(3)
    for B, E, N, G in [(1, 64, 32, 8), (5, 16, 8, 2), (2, 8, 8, 8), (1, 12, 4, 8), (3, 12, 6, 3), (1, 16, 8, 1),
                       (2, 20, 48, 16)]:  # G = 16: two 8-byte words per node
        for relay in (True, False):
            for frac in (0.0, 0.05, 0.5):
                owner = rng.integers(0, N, E)
                placement = rng.random((B, E, N)) < frac
                placement[:, np.arange(E), owner] = True
                got = prices.gather_links(owner, placement, ranks_per_node=G, chunk_bytes=3.5e6, relay=relay)
                with monkeypatch.context() as m:
                    m.setattr(prices, "_fastplan", None)
                    want = prices.gather_links(owner, placement, ranks_per_node=G, chunk_bytes=3.5e6, relay=relay)
                assert all(np.array_equal(g, w) and g.shape == w.shape for g, w in zip(got, want))
                assert frac < 0.5 or want[0].any()  # replicas to count


def test_group_traffic_in_c_is_the_reference(monkeypatch):
    """sim/links.traffic_BNN in C (_fastplan.plan_traffic, grouped) gives the numpy reference's
    table: B groups' tokens to their single holders (non-contiguous int32 counts, replicated experts
    skipped) and the flows, with and without flows."""
    import numpy as np

    from ds_fssdp.sim import links
    rng = np.random.default_rng(4)
    for B, E, N in [(4, 32, 16), (1, 8, 4)]:
        for with_flows in (False, True):
            tokens_BEN = rng.integers(0, 500, (E, 2 * B, N)).astype(np.int32)[:, :B].transpose(1, 0, 2)
            holder_BE = rng.integers(-1, N, (B, E))
            flows_4F = np.stack([rng.integers(0, B, 40), rng.integers(0, N, 40), rng.integers(0, N, 40),
                                 rng.integers(1, 100, 40)]) if with_flows else None
            got = links.traffic_BNN(tokens_BEN, holder_BE, flows_4F)
            with monkeypatch.context() as m:
                m.setattr(links, "_fastplan", None)
                want = links.traffic_BNN(tokens_BEN, holder_BE, flows_4F)
            assert np.array_equal(got, want) and got.dtype == want.dtype and want.any()


def test_plan_traffic_rejects_flow_ranks_out_of_range():
    """_fastplan.plan_traffic reads raw buffers: a flow's holder or source rank outside [0, D), in
    one group or several, is a ValueError (nothing is written past the table)."""
    import numpy as np
    import pytest

    from ds_fssdp.planner import _fastplan
    E, D = 4, 6
    holder, tokens = np.array([0, 1, -1, 5]), np.ones((E, D), dtype=np.int64)
    for grouped in (False, True):
        for h, d in [(0, 1), (6, 0), (0, 6), (-1, 0), (2, -3)]:
            flows = np.array([[0, 0], [1, h], [2, d], [3, 4]], dtype=np.int64)
            out = np.empty((D, D))
            args = (holder, tokens, flows, out, 1, E, D, 2, grouped)
            if 0 <= h < D and 0 <= d < D:
                _fastplan.plan_traffic(*args)
                assert out[d, h] == 4 + (h == 0) and out.sum() == 3 * D + 3 + 4
            else:
                with pytest.raises(ValueError, match="out of range"):
                    _fastplan.plan_traffic(*args)
