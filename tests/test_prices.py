"""The price list (planner/prices.py), by hand on tiny cases, and its users charging it."""
import numpy as np
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.prices import (allreduce_links, allreduce_share, gather_links, link_seconds,
                                     reduce_scatter_share)
from ds_fssdp.sim.links import sparse_collective_links

HW = Hardware(flops=1e12, intra_bw=100.0, inter_bw=10.0, latency=1.0)


def test_gather_as_the_runtime_moves_it_and_relayed():
    """Expert 0 on rank 0 (node 0) replicated on ranks 2, 3 (node 1) and 4 (node 2), nodes of 2:
    the runtime's collectives send it out of node 0 once per node it enters (2 chunks); relayed,
    once (node 1 forwards it to node 2). Node 1 receives it once; rank links one chunk each."""
    placement_ED = np.zeros((2, 6), dtype=bool)
    placement_ED[0, [0, 2, 3, 4]] = True
    placement_ED[1, 1] = True
    owner_E = np.array([0, 1])
    rank, node = gather_links(owner_E, placement_ED, ranks_per_node=2, chunk_bytes=5.0, relay=False)
    assert rank.tolist() == [[0, 0, 5, 5, 5, 0]] and node.tolist() == [[10, 5, 5]]
    rank, node = gather_links(owner_E, placement_ED, ranks_per_node=2, chunk_bytes=5.0, relay=True)
    assert node.tolist() == [[5, 5, 5]]
    assert link_seconds(5.0, 10.0, HW) == 1.0 + 1.0 and link_seconds(0.0, 0.0, HW) == 0.0
    # the cost model and the simulators' links charge these prices
    cost = CostModel(HW, ExpertShape(hidden=1, ffn=1, matrices=1, param_bytes=5), Topology(6, 2))
    assert cost.gather_time(torch.tensor(owner_E), torch.tensor(placement_ED)) == 1.0 + 10.0 / 10.0
    assert cost.broadcast_time(torch.tensor(owner_E), torch.tensor(placement_ED)) == 1.0 + 5.0 / 10.0
    links = sparse_collective_links(owner_E, placement_ED, ranks_per_node=2, chunk_bytes=5.0)
    assert float(links.time_B(HW)[0]) == cost.gather_time(torch.tensor(owner_E), torch.tensor(placement_ED))


def test_ring_shares_and_allreduce():
    assert allreduce_share(1) == 0.0 and allreduce_share(4) == pytest.approx(1.5)
    assert reduce_scatter_share(4) == pytest.approx(0.75)
    members = np.array([[1, 1, 1, 1], [1, 0, 1, 0]], dtype=bool)  # the world, and ranks 0, 2 (2 nodes of 2)
    rank, node = allreduce_links(members, np.array([8.0, 4.0]), ranks_per_node=2)
    assert rank.tolist() == [16.0, 12.0, 16.0, 12.0] and node.tolist() == [16.0, 16.0]
    cost = CostModel(HW, ExpertShape(hidden=1, ffn=1), Topology(4, 2))
    assert cost.allreduce_time(torch.tensor(members), torch.tensor([8.0, 4.0])) == 1.0 + 16.0 / 10.0
    assert cost.edp_reduce_linear(4, partitioned=False).per_unit_s == pytest.approx(1.5 / 10.0)
    assert cost.edp_reduce_linear(4, partitioned=True).per_unit_s == pytest.approx(3.0 / 10.0)


@pytest.mark.parametrize("seed", range(4))
def test_gather_price_is_what_the_runtime_moves(seed):
    """The runtime's SparseAllGather (planner/transfers.gather_layout, two phases across nodes):
    the chunks each node sends out and takes in over its node link, and each rank receives, are
    what gather_links(relay=False) prices; relayed pricing undercounts a node's sends."""
    from ds_fssdp.planner.inputs import GATHER_RELAY
    from ds_fssdp.planner.transfers import gather_layout
    gen = torch.Generator().manual_seed(seed)
    E, D, G = 12, 8, 2
    topo = Topology(D, G)
    owner_E = torch.arange(E) % D
    placement_ED = torch.rand(E, D, generator=gen) < 0.4
    placement_ED[torch.arange(E), owner_E] = True
    node_out, node_in, rank_in = np.zeros(D // G), np.zeros(D // G), np.zeros(D)
    for r in range(D):
        for phase in gather_layout(owner_E, placement_ED, r, topology=topo).phases:
            for peer, k in enumerate(phase.send_splits):
                if peer // G != r // G:
                    node_out[r // G] += k
            for peer, k in enumerate(phase.recv_splits):
                rank_in[r] += k
                if peer // G != r // G:
                    node_in[r // G] += k
    rank, node = gather_links(owner_E.numpy(), placement_ED.numpy(), ranks_per_node=G, chunk_bytes=1.0,
                              relay=GATHER_RELAY)
    assert rank[0].tolist() == rank_in.tolist()
    assert node[0].tolist() == np.maximum(node_out, node_in).tolist()
    _, relayed = gather_links(owner_E.numpy(), placement_ED.numpy(), ranks_per_node=G, chunk_bytes=1.0, relay=True)
    assert (relayed[0] <= node[0]).all()
    if seed in (0, 3):  # negative control: here the relayed price of the busiest node link is lower
        assert relayed.max() < node.max() == np.maximum(node_out, node_in).max()
