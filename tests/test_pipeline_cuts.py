"""moe/pipeline.ChunkPlan: the ragged cuts and atoms of a chunked exchange, against a direct
per-pair count (no communication)."""
from fractions import Fraction

import torch

from ds_fssdp.moe.pipeline import ChunkPlan, atom_cuts, cut


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
        for u, (pos, per_slot) in enumerate(plan.units):
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
