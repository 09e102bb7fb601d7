"""The planner's C paths give exactly what the Python references give (random instances)."""
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import fast, homogeneous_owner
from ds_fssdp.planner.balance import balanced_dispatch, balanced_dispatch_reference
from ds_fssdp.planner.dispatch import dispatch, paper_dispatch_reference
from ds_fssdp.planner.joint import joint_materialize, joint_materialize_reference
from ds_fssdp.planner.materialize import materialize, materialize_reference

SHAPES = [(8, 8, 4), (16, 8, 2), (64, 32, 8), (6, 4, 2), (4, 8, 4), (12, 6, 3), (3, 2, 1)]


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
        m = int(torch.randint(0, 4, (1, ), generator=gen))
        want = materialize_reference(owner, tokens.sum(1), topo, overlap_degree=t, budget=m)
        assert torch.equal(materialize(owner, tokens.sum(1), topo, overlap_degree=t, budget=m), want)
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
