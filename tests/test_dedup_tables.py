"""One copy per destination's index math (moe/dedup.py), in one process (no ranks spawned; the
distributed runs are tests/test_dedup.py):

* over every rank of a plan: one sent row per distinct (token, destination) pair, and the
  receiver rebuilds exactly the per-assignment path's compute rows;
* the flow on one rank (the exchange the identity) equals the per-assignment flow, with gradients.
"""

import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.moe.compute import dispatch_compute_combine, dispatch_compute_combine_dedup, local_exchange
from ds_fssdp.moe.dedup import DedupRoute, receive_tables, send_tables
from ds_fssdp.moe.routing import route, route_reference
from ds_fssdp.planner import homogeneous_owner
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.joint import joint_materialize


def _topk(gen, T, E, K, skew=1.5):
    """T tokens' top-K distinct experts, skewed towards a few."""
    logits = torch.randn(T, E, generator=gen) + torch.randn(E, generator=gen) * skew
    return logits.topk(K, dim=1).indices if T else torch.zeros(0, K, dtype=torch.long)


def _world(seed, E, D, G, K, tokens, budget=2):
    """Every rank's routing, one plan agreeing with all of them, and each rank's local experts."""
    gen = torch.Generator().manual_seed(seed)
    idx = [_topk(gen, T, E, K) for T in tokens]
    tokens_ED = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx], 1)
    topo = Topology(num_ranks=D, ranks_per_node=G)
    placement_ED = joint_materialize(homogeneous_owner(E, D), tokens_ED.double(), topo, overlap_degree=4,
                                     budget=budget)
    plan = dispatch_plan(placement_ED, tokens_ED, topo, mode="balanced", slack=0.03)
    local = [torch.nonzero(placement_ED[:, d]).flatten() for d in range(D)]
    return idx, plan, local


def _pairs(r, rank_tokens):
    """The distinct (token, destination) pairs of a route, from its send order (brute force)."""
    dest = torch.repeat_interleave(torch.arange(len(r.send_splits)), torch.tensor(r.send_splits))
    return sorted(set(zip(r.send_token.tolist(), dest.tolist())))


WORLDS = [  # (seed, E, D, G, K, tokens per rank, replicas per rank)
    (1, 16, 4, 2, 2, (40, 0, 25, 31), 2),
    (2, 8, 4, 2, 4, (30, 17, 1, 22), 2),
    (3, 32, 8, 4, 4, (60, 45, 0, 12, 80, 33, 7, 50), 2),
    (4, 6, 2, 1, 3, (9, 13), 0),
]


@pytest.mark.parametrize("seed,E,D,G,K,tokens,budget", WORLDS)
def test_one_sent_row_per_distinct_token_destination(seed, E, D, G, K, tokens, budget):
    idx, plan, local = _world(seed, E, D, G, K, tokens, budget)
    saved = 0
    for rank in range(D):
        r = route(idx[rank], plan, rank=rank, local_E=local[rank])
        s = send_tables(r, tokens[rank], K)
        pairs = _pairs(r, tokens[rank])
        assert s.token_U.tolist() == [t for t, _ in sorted(pairs, key=lambda p: (p[1], p[0]))]
        assert s.splits == [sum(1 for _, d in pairs if d == h) for h in range(D)]
        assert sum(s.splits) == len(pairs) < tokens[rank] * K or tokens[rank] == 0 or K == 1
        # A token's sent rows, in destination order, each once; -1 fills the rest.
        listed = s.uniq_TK[s.uniq_TK >= 0]
        assert sorted(listed.tolist()) == list(range(len(pairs)))
        assert torch.equal(s.token_U[s.uniq_TK.clamp(min=0)][s.uniq_TK >= 0],
                           torch.nonzero(s.uniq_TK >= 0)[:, 0])
        # The routing entries: one per assignment, at the assignment's own slot.
        assert int((s.meta_UK >= 0).sum()) == tokens[rank] * K
        saved += sum(r.send_splits[h] - s.splits[h] for h in range(D) if h != rank)
    assert saved > 0  # the worlds crowd experts: some token picks two experts on one rank


@pytest.mark.parametrize("seed,E,D,G,K,tokens,budget", WORLDS)
def test_receiver_rebuilds_the_per_assignment_compute_rows(seed, E, D, G, K, tokens, budget):
    """Every rank's exchange emulated: the compute rows a receiver expands are, row for row, the
    (source, token) rows of the per-assignment path."""
    idx, plan, local = _world(seed, E, D, G, K, tokens, budget)
    routes = [route_reference(idx[d], plan, rank=d, local_E=local[d]) for d in range(D)]
    sends = [send_tables(r, tokens[d], K) for d, r in enumerate(routes)]
    for h in range(D):
        r = routes[h]
        recv_splits = [sends[s].splits[h] for s in range(D)]
        # Source s's rows for h: its (destination h) block of unique rows, with their entries.
        blocks = [sum(sends[s].splits[:h]) for s in range(D)]
        meta = torch.cat([sends[s].meta_UK[blocks[s]:blocks[s] + recv_splits[s]] for s in range(D)])
        who = torch.cat([torch.stack([torch.full((recv_splits[s], ), s), sends[s].token_U[blocks[s]:blocks[s] +
                                                                                        recv_splits[s]]], 1)
                         for s in range(D)])
        rows_UK, token_C = receive_tables(r, meta, recv_splits)
        # The per-assignment path: compute row c is receive row group_perm[c], from source s at
        # position p of its block, which is source s's send row (its block for h) p.
        recv_end = torch.cumsum(torch.tensor(r.recv_splits), 0)
        want = []
        for c in range(r.group_perm.numel()):
            row = int(r.group_perm[c])
            s = int(torch.searchsorted(recv_end, torch.tensor(row), right=True))  # the block holding row
            p = row - int(recv_end[s]) + r.recv_splits[s]
            want.append((s, int(routes[s].send_token[sum(routes[s].send_splits[:h]) + p])))
        assert [tuple(x) for x in who[token_C].tolist()] == want
        assert torch.equal(torch.sort(rows_UK[rows_UK >= 0]).values, torch.arange(token_C.numel()))


def _expert_fn(W_EHH):
    def fn(x_CH, sizes):
        out, i = [], 0
        for e, n in enumerate(sizes):
            out.append(torch.tanh(x_CH[i:i + n] @ W_EHH[e]))
            i += n
        return torch.cat(out) if out else x_CH[:0]
    return fn


@pytest.mark.parametrize("K", [1, 2, 4])
def test_one_rank_flow_equals_per_assignment_flow(K):
    gen = torch.Generator().manual_seed(K)
    T, E, H = 23, 6, 5
    idx_TK = _topk(gen, T, E, K)
    counts = torch.bincount(idx_TK.reshape(-1), minlength=E).view(-1, 1, 1)
    r = route(idx_TK, counts, rank=0, local_E=torch.arange(E))
    s = send_tables(r, T, K)
    assert s.splits == [T]  # one destination: every token once
    rows_UK, token_C = receive_tables(r, s.meta_UK, s.splits)
    dr = DedupRoute(route=r, send=s, recv_splits=s.splits, rows_UK=rows_UK, token_C=token_C,
                    uniq_DD=torch.tensor([s.splits]))
    fn = _expert_fn(torch.randn(E, H, H, generator=gen))
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    w = torch.rand(T, K, generator=gen, requires_grad=True)
    g = torch.randn(T, H, generator=gen)
    got, want = [], []
    for out, flow, route_ in ((got, dispatch_compute_combine_dedup, dr), (want, dispatch_compute_combine, r)):
        y = flow(x, w, route_, expert_fn=fn, exchange=local_exchange)
        out += [y.detach(), *torch.autograd.grad((y * g).sum(), [x, w])]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
