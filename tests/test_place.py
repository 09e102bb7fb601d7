"""planner.place (the one pre-gating entry point): each setting reaches its placement, and the
configuration refuses the removed "cost" placement by name."""
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.planner import homogeneous_owner, materialize, place, shard_placement
from ds_fssdp.planner.joint import joint_materialize


def _instance(gen, E, D, total):
    share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
    return torch.distributions.Multinomial(total_count=total, probs=share).sample((D, )).t().double()


def test_place_dispatches_by_setting():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    tokens = _instance(torch.Generator().manual_seed(3), 16, 8, 4000)
    opts = lambda **kw: {"placement": "paper", "overlap_degree": 4, "budget": 2, **kw}
    shard = shard_placement(owner, 8)
    assert torch.equal(place(owner, None, topo, **opts()), shard)
    joint = joint_materialize(owner, tokens, topo, overlap_degree=4, budget=2)
    assert torch.equal(place(owner, tokens, topo, **opts(placement="joint")), joint)
    alg1 = materialize(owner, tokens.sum(1), topo, overlap_degree=4, budget=2)
    assert torch.equal(place(owner, tokens, topo, **opts(placement="paper")), alg1)
    assert torch.equal(place(owner, tokens.sum(1), topo, **opts(placement="joint")), alg1)  # loads only
    with pytest.raises(ValueError, match="overlap_degree"):
        place(owner, tokens, topo, **opts(overlap_degree="auto"))
    for removed in ("best", "cost"):
        with pytest.raises(ValueError, match="placement"):
            place(owner, tokens, topo, **opts(placement=removed))


def test_config_refuses_the_removed_cost_placement_by_name():
    with pytest.raises(FSSDPConfigError, match=r"fssdp.placement \('cost'\).*'cost' was removed"):
        FSSDPConfig.from_ds_config({"fssdp": {"placement": "cost"}})
    assert FSSDPConfig.from_ds_config({"fssdp": {"placement": "paper"}}).placement == "paper"
