"""route() (linear time, in C) gives exactly route_reference()'s orders (key sorts), for compact
and dense plans, any order of the local experts, with the expert grouping taken before the plan or
not, and rejects what the reference rejects."""
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.moe.routing import expert_order, route, route_device, route_reference
from ds_fssdp.planner import homogeneous_owner
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.joint import joint_materialize

FIELDS = ("send_token", "unsend", "group_perm", "ungroup_perm")
LISTS = ("send_splits", "recv_splits", "group_sizes")


def test_the_c_extension_is_built():
    from ds_fssdp.moe import routing
    assert routing._fastroute is not None, "ds_fssdp.moe._fastroute is missing: reinstall with `pip install -e .`"


def assert_same(a, b):
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype == torch.long, k
        assert torch.equal(x, y), k
    for k in LISTS:
        assert getattr(a, k) == getattr(b, k), k


def instance(seed, E, D, G, K, T, rank, mode="balanced"):
    """A rank's top-K routing and a plan on a skewed placement whose counts agree with it."""
    gen = torch.Generator().manual_seed(seed)
    topo = Topology(num_ranks=D, ranks_per_node=G)
    share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
    idx_TK = (torch.multinomial(share, T * K, replacement=True, generator=gen).reshape(T, K) if T
              else torch.zeros(0, K, dtype=torch.long))
    tokens_ED = torch.distributions.Multinomial(total_count=max(T * K, 1), probs=share).sample((D, )).t().long()
    tokens_ED[:, rank] = torch.bincount(idx_TK.reshape(-1), minlength=E)
    placement_ED = joint_materialize(homogeneous_owner(E, D), tokens_ED.double(), topo, overlap_degree=4, budget=2)
    plan = dispatch_plan(placement_ED, tokens_ED, topo, mode=mode, slack=0.03)
    local_E = torch.nonzero(placement_ED[:, rank]).flatten()
    return idx_TK, plan, local_E[torch.randperm(local_E.numel(), generator=gen)]  # any slot order


@pytest.mark.parametrize("E,D,G,K,T", [(16, 8, 4, 2, 500), (6, 4, 2, 3, 9), (8, 2, 1, 1, 0), (64, 16, 4, 2, 2000)])
@pytest.mark.parametrize("mode", ["balanced", "paper"])
def test_route_matches_reference(E, D, G, K, T, mode):
    for rank in range(D):
        idx_TK, plan, local_E = instance(rank + 100 * E, E, D, G, K, T, rank, mode)
        want = route_reference(idx_TK, plan, rank=rank, local_E=local_E)
        assert_same(route(idx_TK, plan, rank=rank, local_E=local_E), want)
        split = route(idx_TK, plan, rank=rank, local_E=local_E, grouped=expert_order(idx_TK, E))
        assert split._finish is not None, "the compact plan's route leaves its second half for later"
        assert_same(split, want)
        dense = plan.dense()
        assert_same(route(idx_TK, dense, rank=rank, local_E=local_E),
                    route_reference(idx_TK, dense, rank=rank, local_E=local_E))


@pytest.mark.parametrize("E,D,G,K,T", [(16, 8, 4, 2, 500), (6, 4, 2, 3, 9), (64, 32, 8, 2, 3000)])
def test_device_route_matches_the_c_route(E, D, G, K, T):
    """route_device (torch ops, what CUDA tensors take) on CPU tensors equals the C route."""
    for rank in range(0, D, max(1, D // 4)):
        for mode in ("balanced", "paper"):
            idx_TK, plan, local_E = instance(7 + rank + 100 * E, E, D, G, K, T, rank, mode)
            assert_same(route_device(idx_TK, plan, rank=rank, local_E=local_E),
                        route(idx_TK, plan, rank=rank, local_E=local_E))


def test_route_single_rank_dense_counts():
    """The local layer's use: a [E, 1, 1] plan of the counts, every expert held."""
    gen = torch.Generator().manual_seed(3)
    idx_TK = torch.randint(0, 5, (40, 2), generator=gen)
    counts = torch.bincount(idx_TK.reshape(-1), minlength=5).view(-1, 1, 1)
    assert_same(route(idx_TK, counts, rank=0, local_E=torch.arange(5)),
                route_reference(idx_TK, counts, rank=0, local_E=torch.arange(5)))


def test_route_rejects_bad_expert_indices_and_repeated_local_experts():
    idx_TK, plan, local_E = instance(8, 16, 8, 4, 2, 300, 2)
    for bad in (16, -1):
        wrong = idx_TK.clone()
        wrong[3, 1] = bad
        for fn in (route, route_reference):
            with pytest.raises(RuntimeError):
                fn(wrong, plan, rank=2, local_E=local_E)
    with pytest.raises(ValueError, match="repeats"):
        route(idx_TK, plan, rank=2, local_E=torch.cat([local_E, local_E[:1]]))


def test_route_without_the_extension_is_the_reference(monkeypatch):
    import ds_fssdp.moe.routing as routing
    idx_TK, plan, local_E = instance(9, 16, 8, 4, 2, 300, 5)
    want = route(idx_TK, plan, rank=5, local_E=local_E)
    monkeypatch.setattr(routing, "_fastroute", None)
    assert_same(routing.route(idx_TK, plan, rank=5, local_E=local_E), want)


def test_route_rejects_what_the_reference_rejects():
    idx_TK, plan, local_E = instance(7, 16, 8, 4, 2, 300, 2)
    wrong = idx_TK.clone()
    wrong[0, 0] = (wrong[0, 0] + 1) % 16  # counts no longer match the plan
    for fn in (route, route_reference):
        with pytest.raises(RuntimeError, match="disagree with the dispatch plan"):
            fn(wrong, plan, rank=2, local_E=local_E)
    received = plan.received(2).sum(1)
    assert int((received > 0).sum()) > 1
    e = int(torch.nonzero(received).flatten()[0])  # drop an expert this rank computes rows of
    fewer = local_E[local_E != e]
    for fn in (route, route_reference):
        with pytest.raises(RuntimeError, match=rf"does not hold: \[{e}\]"):
            fn(idx_TK, plan, rank=2, local_E=fewer)
