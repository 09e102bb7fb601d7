"""moe/pipeline.ChunkPlan: the ragged cuts and atoms of a chunked exchange, against a direct
per-pair count (no communication); with one copy per destination (``expand``), each unit's own
expand tables rebuild exactly its part of the receiver's expansion."""
from fractions import Fraction

import torch

from ds_fssdp.moe.compute import expand_received
from ds_fssdp.moe.pipeline import ChunkPlan, atom_cuts, cut
from ds_fssdp.ops.permute_torch import invert_rows


def test_atoms_are_the_union_of_both_directions_cuts():
    assert atom_cuts(1, 1) == [Fraction(0), Fraction(1)]
    assert atom_cuts(2, 3) == [Fraction(0), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3), Fraction(1)]
    assert atom_cuts(4, 2) == [Fraction(i, 4) for i in range(5)]
    # floor(n q): a pair of 5 rows at degree 3 is cut 1, 2, 2 (ragged); of 2 rows at degree 4: 0, 1, 0, 1.
    assert [cut(5, Fraction(i, 3)) for i in range(4)] == [0, 1, 3, 5]
    assert [cut(2, Fraction(i, 4)) for i in range(5)] == [0, 0, 1, 1, 2]


def test_chunk_plan_matches_a_per_pair_count():
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        D = int(torch.randint(1, 6, (1, ), generator=gen))
        rank = int(torch.randint(0, D, (1, ), generator=gen))
        recv = torch.randint(0, 9, (D, ), generator=gen).tolist()
        send = torch.randint(0, 9, (D, ), generator=gen).tolist()
        f, b = (int(v) for v in torch.randint(1, 5, (2, ), generator=gen))
        R, S = sum(recv), 3
        perm = torch.randperm(R, generator=gen)  # compute order <- receive order
        sizes = [len(range(s, R, S)) for s in range(S)]
        plan = ChunkPlan(rank=rank, degrees=(f, b), send_splits=send, recv_splits=recv, group_perm=perm,
                         group_sizes=sizes)
        A = len(plan.cuts) - 1
        want = []
        for s, m in enumerate(recv):
            for j in range(m):
                want.append(A if s == rank else
                            next(a for a in range(A) if cut(m, plan.cuts[a]) <= j < cut(m, plan.cuts[a + 1])))
        got = torch.full((R, ), -1)
        slot_C = torch.repeat_interleave(torch.arange(S), torch.tensor(sizes))
        where_C = torch.empty(R, dtype=torch.long)
        where_C[perm] = torch.arange(R)  # receive row -> compute position
        for u, (pos, per_slot, tables) in enumerate(plan.units):
            assert tables is None
            got[pos] = u
            assert per_slot == torch.bincount(slot_C[where_C[pos]], minlength=S).tolist()
            assert bool((where_C[pos].diff() > 0).all())  # compute order kept inside a unit
        assert got.tolist() == want
        # Every direction's chunks are runs of whole atoms covering every atom once.
        for deg in (f, b):
            atoms = [a for i in range(deg) for a in plan.chunk(deg, i)[2]]
            assert atoms == list(range(A))
        # Ranges: chunk i of each remote peer's block, None for this rank; chunks tile the block.
        for side, splits in (("send", send), ("recv", recv)):
            spans = [plan.ranges(side, *plan.chunk(f, i)[:2]) for i in range(f)]
            off = 0
            for d, n in enumerate(splits):
                if d == rank:
                    assert all(sp[d] is None for sp in spans)
                    assert plan.local(side) == (off, off + n)
                else:
                    assert spans[0][d][0] == off and spans[-1][d][1] == off + n
                    assert all(spans[i][d][1] == spans[i + 1][d][0] for i in range(f - 1))
                off += n


def test_expanded_units_split_the_receivers_expansion():
    gen = torch.Generator().manual_seed(1)
    K, S = 3, 4
    for _ in range(40):
        D = int(torch.randint(1, 5, (1, ), generator=gen))
        rank = int(torch.randint(0, D, (1, ), generator=gen))
        recv = torch.randint(0, 6, (D, ), generator=gen).tolist()
        f, b = (int(v) for v in torch.randint(1, 5, (2, ), generator=gen))
        U = sum(recv)
        # Each received row carries 1..K slots; compute rows are the slots, in a random compute order.
        valid_UK = torch.rand(U, K, generator=gen) < 0.5
        valid_UK[torch.arange(U), torch.randint(0, K, (U, ), generator=gen)] = True
        C = int(valid_UK.sum())
        rows_UK = torch.full((U, K), -1, dtype=torch.long)
        rows_UK[valid_UK] = torch.randperm(C, generator=gen)
        token_C = invert_rows(rows_UK, C) // K
        sizes = torch.bincount(torch.randint(0, S, (C, ), generator=gen), minlength=S).tolist()
        slot_C = torch.repeat_interleave(torch.arange(S), torch.tensor(sizes))
        plan = ChunkPlan(rank=rank, degrees=(f, b), send_splits=recv, recv_splits=recv, group_perm=None,
                         group_sizes=sizes, expand=(rows_UK, token_C))
        # The received rows' units are the per-assignment plan's over the same splits.
        plain = ChunkPlan(rank=rank, degrees=(f, b), send_splits=recv, recv_splits=recv,
                          group_perm=torch.arange(U), group_sizes=[U])
        unit_U = torch.full((U, ), -1)
        for u, (pos, _, _) in enumerate(plain.units):
            unit_U[pos] = u
        x_UH = torch.randn(U, 2, generator=gen)
        x_CH = expand_received(x_UH, token_C, rows_UK)
        seen = torch.zeros(C, dtype=torch.long)
        for a, (pos, per_slot, (token_c, rows_uk)) in enumerate(plan.units):
            assert pos.tolist() == torch.nonzero(unit_U == a).flatten().tolist()
            c = torch.nonzero(unit_U[token_C] == a).flatten()  # compute order kept
            seen[c] += 1
            assert per_slot == torch.bincount(slot_C[c], minlength=S).tolist()
            assert torch.equal(expand_received(x_UH[pos], token_c, rows_uk), x_CH[c])
            assert torch.equal(torch.where(rows_uk >= 0, c[rows_uk.clamp(min=0)] if c.numel() else rows_uk, -1),
                               rows_UK[pos])
        assert seen.tolist() == [1] * C
