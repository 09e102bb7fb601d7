"""One copy per destination's index math (moe/dedup.py), in one process (no ranks spawned; the
distributed runs are tests/test_dedup.py):

* over every rank of a plan: one sent row per distinct (token, destination) pair (two hops: per
  distinct (token, destination node) first, to the relay with the sender's local index), and the
  receiver rebuilds exactly the per-assignment path's compute rows, over one hop or two;
* the flow on one rank (the exchange the identity) equals the per-assignment flow, with gradients.
"""

import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.moe.compute import dispatch_compute_combine, dispatch_compute_combine_dedup, local_exchange
from ds_fssdp.moe.dedup import DedupRoute, hop_entries, hop_tables, receive_tables, relay_of, slot_targets
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
    (5, 24, 8, 2, 3, (20, 31, 0, 9, 14, 5, 27, 18), 1),
]


def _targets(plan, routes, tokens, K):
    traffic = plan.traffic_DD()
    return [slot_targets(r, tokens[d], K, traffic[:d].sum(0)) for d, r in enumerate(routes)]


@pytest.mark.parametrize("seed,E,D,G,K,tokens,budget", WORLDS)
def test_one_sent_row_per_distinct_token_destination(seed, E, D, G, K, tokens, budget):
    idx, plan, local = _world(seed, E, D, G, K, tokens, budget)
    routes = [route(idx[d], plan, rank=d, local_E=local[d]) for d in range(D)]
    saved = 0
    for rank, (dest_TK, pos_TK) in enumerate(_targets(plan, routes, tokens, K)):
        r = routes[rank]
        hop = hop_tables(dest_TK, D)
        pairs = _pairs(r, tokens[rank])
        assert hop.token_U.tolist() == [t for t, _ in sorted(pairs, key=lambda p: (p[1], p[0]))]
        assert hop.splits == [sum(1 for _, d in pairs if d == h) for h in range(D)]
        # A token's sent rows, in destination order, each once; -1 fills the rest.
        listed = hop.uniq_TK[hop.uniq_TK >= 0]
        assert sorted(listed.tolist()) == list(range(len(pairs)))
        assert torch.equal(hop.token_U[hop.uniq_TK.clamp(min=0)][hop.uniq_TK >= 0],
                           torch.nonzero(hop.uniq_TK >= 0)[:, 0])
        # Each slot is carried by exactly one row: its token's row for its destination.
        assert int(hop.mask_UK.sum()) == tokens[rank] * K
        # Two hops: the first sends one row per distinct (token, destination node).
        relay = hop_tables(relay_of(dest_TK, rank, G), D)
        assert sum(relay.splits) == len({(t, d // G) for t, d in pairs})
        assert all(n == 0 or h % G == rank % G for h, n in enumerate(relay.splits))
        saved += sum(r.send_splits[h] - hop.splits[h] for h in range(D) if h != rank)
    assert saved > 0  # the worlds crowd experts: some token picks two experts on one remote rank


def _emulate(routes, targets, tokens, D, G, two_hops):
    """Every rank's hops run in one process; each slot carries a tag (source, token). Returns per
    rank the received (receive position, source, token) of its final hop's rows."""
    state = [(dest, pos, torch.full_like(dest, s), torch.arange(tokens[s]).unsqueeze(1).expand_as(dest))
             for s, (dest, pos) in enumerate(targets)]
    for first in ((True, False) if two_hops else (False, )):
        hops = [hop_tables(relay_of(f[0], s, G) if first else f[0], D) for s, f in enumerate(state)]
        sent = [hop_entries(hops[s], *f) for s, f in enumerate(state)]
        K = state[0][0].shape[1]
        new = []
        for h in range(D):
            rows = torch.cat([sent[s][sum(hops[s].splits[:h]):sum(hops[s].splits[:h + 1])] for s in range(D)])
            new.append(tuple(rows[:, i * K:(i + 1) * K] for i in range(4)))
        state = new
    return [f[1:] for f in state]


@pytest.mark.parametrize("two_hops", [False, True])
@pytest.mark.parametrize("seed,E,D,G,K,tokens,budget", WORLDS)
def test_receiver_rebuilds_the_per_assignment_compute_rows(seed, E, D, G, K, tokens, budget, two_hops):
    """Every rank's exchanges emulated, over one hop or two (via the relays): the compute rows a
    receiver expands are, row for row, the (source, token) rows of the per-assignment path."""
    idx, plan, local = _world(seed, E, D, G, K, tokens, budget)
    routes = [route_reference(idx[d], plan, rank=d, local_E=local[d]) for d in range(D)]
    received = _emulate(routes, _targets(plan, routes, tokens, K), tokens, D, G, two_hops)
    for h in range(D):
        r = routes[h]
        pos_UK, src_UK, tok_UK = received[h]
        rows_UK, token_C = receive_tables(r, pos_UK)
        # The per-assignment path: compute row c is receive row group_perm[c], from source s at
        # position p of its block, which is source s's send row (its block for h) p.
        recv_end = torch.cumsum(torch.tensor(r.recv_splits), 0)
        want = []
        for c in range(r.group_perm.numel()):
            row = int(r.group_perm[c])
            s = int(torch.searchsorted(recv_end, torch.tensor(row), right=True))  # the block holding row
            p = row - int(recv_end[s]) + r.recv_splits[s]
            want.append((s, int(routes[s].send_token[sum(routes[s].send_splits[:h]) + p])))
        slot = torch.nonzero(rows_UK >= 0)
        got = [None] * token_C.numel()
        for u, k in slot.tolist():
            got[int(rows_UK[u, k])] = (int(src_UK[u, k]), int(tok_UK[u, k]))
        assert got == want
        assert torch.equal(token_C[rows_UK[rows_UK >= 0]], slot[:, 0])


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
    dest_TK, pos_TK = slot_targets(r, T, K, torch.zeros(1, dtype=torch.long))
    hop = hop_tables(dest_TK, 1)
    assert hop.splits == [T]  # one destination: every token once
    hop.recv_splits, hop.uniq_DD = hop.splits, torch.tensor([hop.splits])
    rows_UK, token_C = receive_tables(r, hop_entries(hop, pos_TK))
    dr = DedupRoute(route=r, hops=[hop], rows_UK=rows_UK, token_C=token_C)
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


def test_staged_hop_is_the_same_rows_in_destination_stage_order():
    """A staged hop (a relay's last hop when both hops are chunked, ``moe/relay.py``) sends the same
    distinct (row, destination) rows in the order (destination, stage, row), with each row's sent
    rows in destination order as unstaged, and counts them per (destination, stage)."""
    gen = torch.Generator().manual_seed(7)
    T, K, D, A = 23, 3, 4, 3
    dest_TK = torch.randint(-1, D, (T, K), generator=gen)
    stage_T = torch.randint(0, A, (T, ), generator=gen)
    stage_TK = torch.where(dest_TK == 0, A - 1, stage_T.unsqueeze(1))  # a row's stage may differ by destination
    stage = lambda t, d: A - 1 if d == 0 else int(stage_T[t])  # noqa: E731
    plain, staged = hop_tables(dest_TK, D), hop_tables(dest_TK, D, stage_TK=stage_TK, stages=A)
    assert plain.stage_splits is None and staged.splits == plain.splits
    dest_U = torch.repeat_interleave(torch.arange(D), torch.tensor(staged.splits))
    key_U = [(int(d), stage(t, d), int(t)) for d, t in zip(dest_U, staged.token_U)]
    assert key_U == sorted(key_U) and len(set(key_U)) == len(key_U)
    assert sorted(key_U) == sorted((int(d), stage(t, d), int(t))
                                   for d, t in zip(torch.repeat_interleave(torch.arange(D), torch.tensor(plain.splits)),
                                                   plain.token_U))
    want = torch.zeros(D, A, dtype=torch.long)
    for d, s, _ in key_U:
        want[d, s] += 1
    assert torch.equal(staged.stage_splits, want)
    for t in range(T):  # a row's sent rows: its distinct destinations in order, carrying its slots
        sent = [int(u) for u in staged.uniq_TK[t] if u >= 0]
        assert [int(dest_U[u]) for u in sent] == sorted({int(d) for d in dest_TK[t] if d >= 0})
        assert all(int(staged.token_U[u]) == t for u in sent)
        for u in sent:
            assert torch.equal(staged.mask_UK[u], dest_TK[t] == dest_U[u])
