"""Replicas that calibration evicts after gating (moe/replicas.py ``gather_now``'s ``drop_ED``):
the layers still equal the single-process reference (outputs, input and gate gradients, owned
expert gradients), at degree 1 and pipelined, with re-materialization on and off, under
activation checkpointing and with 2 logical nodes; the evicted replicas are neither computed on,
reduced nor re-gathered, and the stats count them."""
import pytest
import torch

from distributed import spawn
from layer_cases import attach_shards, forward_backward
from test_pipeline import TOL, _reference, make_layers, placements

pytestmark = pytest.mark.distributed  # spawns ranks

H, E = 8, 6
WORLD = 4
CASES = [
    dict(seed=21, deg=(1, 1), rpn=4, act="gelu", tokens=(7, 5, 9, 3), layers=2),
    dict(seed=22, deg=(3, 2), rpn=2, act="swiglu", tokens=(4, 11, 6, 8), layers=2, remat=True),
    dict(seed=23, deg=(2, 3), rpn=2, act="gelu", tokens=(5, 8, 11, 2), layers=2, ckpt="torch"),
    dict(seed=24, deg=(1, 1), rpn=2, act="gelu", tokens=(10, 3, 6, 7), layers=2, remat=True, ckpt="reentrant"),
]


def evicting(owner_E, placed_ED, seed):
    """The post-gating placement of a case: half of the pre-gated replicas evicted, as many
    replicas added elsewhere (seeded, the same on every rank)."""
    from ds_fssdp.planner import shard_placement
    gen = torch.Generator().manual_seed(seed)
    shard_ED = shard_placement(owner_E, placed_ED.shape[1])
    rep = torch.nonzero(placed_ED & ~shard_ED)
    drop = rep[torch.randperm(rep.shape[0], generator=gen)[:max(1, rep.shape[0] // 2)]]
    final_ED = placed_ED.clone()
    final_ED[drop[:, 0], drop[:, 1]] = False
    free = torch.nonzero(~placed_ED)
    add = free[torch.randperm(free.shape[0], generator=gen)[:drop.shape[0]]]
    final_ED[add[:, 0], add[:, 1]] = True
    return final_ED


def _worker(rank, world, cases):
    from ds_fssdp import Topology
    from ds_fssdp.moe.sharded import ShardOptions
    from ds_fssdp.runtime.groups import build_exchange_groups
    out = []
    for case in cases:
        layers = make_layers(case)
        groups = build_exchange_groups(world=world, rank=rank, group_size=world, ranks_per_node=case["rpn"])

        def prepare(s, case=case):
            planner = s.context().planner

            def post_gating(owner_E, placed_ED, tokens_ED, clock=None, *, overlap_t=-1, l=s.layer_index):
                final_ED = evicting(owner_E, placed_ED, 1000 * case["seed"] + l)
                return planner.policy._plan(owner_E, final_ED, calibrated_ED=final_ED & ~placed_ED,
                                            evicted_ED=placed_ED & ~final_ED)
            planner.post_gating = post_gating

        shards = attach_shards(layers, placements(case, world, len(layers)), rank=rank,
                               topo=Topology(num_ranks=world, ranks_per_node=case["rpn"]), exchange=groups,
                               degrees=case["deg"], options=ShardOptions(rematerialize=case.get("remat", False)),
                               prepare=prepare)
        out.append(dict(forward_backward(layers, shards, case, rank, H), stats=[dict(l.last_stats) for l in layers]))
    return out


def test_evicted_replicas_leave_the_results_unchanged():
    results = spawn(WORLD, _worker, CASES)
    for ci, case in enumerate(CASES):
        ref, sums = _reference(case, WORLD)
        for rank in range(WORLD):
            got, want = results[rank][ci], ref[rank]
            torch.testing.assert_close(got["y"], want["y"], **TOL)
            torch.testing.assert_close(got["x_grad"], want["x_grad"], **TOL)
            for g, w in zip(got["gate_grads"], want["gate_grads"]):
                torch.testing.assert_close(g, w, **TOL)
            for (owned_E, grad), full in zip(got["owned"], sums):
                torch.testing.assert_close(grad, full[owned_E], **TOL)
        for l, (owner_E, placed_ED) in enumerate(placements(case, WORLD, case["layers"])):
            final_ED = evicting(owner_E, placed_ED, 1000 * case["seed"] + l)
            evicted, kept = int((placed_ED & ~final_ED).sum()), int(final_ED.sum()) - E
            st = results[0][ci]["stats"][l]
            psi = st["expert_bytes"]
            assert evicted > 0 and st["evicted_replicas"] == evicted and st["replicas"] == kept
            # gathered: the guess (evicted included) and what was added; reduced: what was used
            assert st["gather_bytes"] == (int(placed_ED.sum()) - E + int((final_ED & ~placed_ED).sum())) * psi
            assert st["reduce_bytes"] == kept * psi
            assert sum(results[r][ci]["stats"][l]["reduce_bytes_sent_local"] for r in range(WORLD)) == kept * psi
