"""The sharded layer's outputs and gradients on 2 and 4 gloo ranks, with 1 and 2 logical nodes and
random owners and placements, equal a single-process layer built from the same weights."""
import pytest
import torch

from distributed import spawn

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

H, F, E, K = 8, 12, 6, 2
CASES = [
    # (seed, ranks_per_node, activation, tokens per rank: a function of the rank)
    dict(seed=1, rpn=None, activation="gelu", tokens=(7, 5, 9, 3)),
    dict(seed=2, rpn=1, activation="swiglu", tokens=(4, 11, 6, 8)),
    dict(seed=3, rpn=2, activation="gelu", tokens=(0, 10, 5, 1)),  # a rank with no tokens
    dict(seed=4, rpn=None, activation="swiglu", tokens=(16, 16, 16, 16), empty_placement=True),
]
ATOL = 1e-6  # fp32: the two sides differ only in summation order of identical products


def make_layer(case):
    from ds_fssdp import FSSDPMoE
    torch.manual_seed(case["seed"])
    return FSSDPMoE(hidden_size=H, ffn_hidden_size=F, num_experts=E, k=K, activation=case["activation"],
                    z_loss_coef=0.01, init_std=0.3)


def random_plan(case, world):
    from ds_fssdp.planner import shard_placement
    gen = torch.Generator().manual_seed(100 + case["seed"])
    owner_E = torch.randint(0, world, (E, ), generator=gen)
    placement_ED = shard_placement(owner_E, world)
    if not case.get("empty_placement"):
        placement_ED |= torch.rand(E, world, generator=gen) < 0.4
    return owner_E, placement_ED


def rank_inputs(case, rank):
    gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    T = case["tokens"][rank]
    return torch.randn(T, H, generator=gen) * 2, torch.randn(T, H, generator=gen)


def _worker(rank, world, cases):
    from ds_fssdp import Topology
    from ds_fssdp.moe.sharded import ShardedExperts
    from ds_fssdp.planner import LoadPredictor
    out = []
    for case in cases:
        layer = make_layer(case)
        owner_E, placement_ED = random_plan(case, world)
        rows = layer.spec.flatten(layer.export_experts())[owner_E == rank]
        topo = Topology(num_ranks=world, ranks_per_node=case["rpn"] or world)
        sharded = ShardedExperts(spec=layer.spec, layer_index=0, owner_E=owner_E, rows_SP=rows, topology=topo,
                                 group=None, predictor=LoadPredictor(E))
        sharded.plan_placement = lambda ctx: (placement_ED, -1)
        layer.attach_sharded(sharded)
        x, dy = rank_inputs(case, rank)
        x.requires_grad_(True)
        y, l_aux, counts = layer(x)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        sharded.accumulate_grads()
        out.append(dict(y=y.detach(), l_aux=l_aux.detach(), x_grad=x.grad, gate_grad=layer.gate.weight.grad,
                        owned_E=sharded.owned_E, owned_grad=sharded.master.grad.clone(), stats=layer.last_stats))
    return out


def _reference(case, world):
    layer = make_layer(case)
    per_rank = []
    for rank in range(world):
        layer.zero_grad()
        x, dy = rank_inputs(case, rank)
        x.requires_grad_(True)
        y, l_aux, _ = layer(x)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        per_rank.append(dict(y=y.detach(), l_aux=l_aux.detach(), x_grad=x.grad, gate_grad=layer.gate.weight.grad.clone(),
                             expert_grads=layer.spec.flatten({n: getattr(layer, n).grad for n in layer.spec.names})))
    expert_sum = torch.stack([r["expert_grads"] for r in per_rank]).sum(0)
    return per_rank, expert_sum


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layer_matches_single_process(world):
    cases = [dict(c, tokens=c["tokens"][:world], rpn=(c["rpn"] if c["rpn"] and world % c["rpn"] == 0 else None))
             for c in CASES]
    results = spawn(world, _worker, cases)
    for ci, case in enumerate(cases):
        ref, expert_sum = _reference(case, world)
        _, placement_ED = random_plan(case, world)
        owner_E, _ = random_plan(case, world)
        added = int(placement_ED.sum()) - E
        for rank in range(world):
            got, want = results[rank][ci], ref[rank]
            torch.testing.assert_close(got["y"], want["y"], atol=ATOL, rtol=1e-5)
            torch.testing.assert_close(got["l_aux"], want["l_aux"], atol=ATOL, rtol=1e-6)
            torch.testing.assert_close(got["x_grad"], want["x_grad"], atol=ATOL, rtol=1e-5)
            torch.testing.assert_close(got["gate_grad"], want["gate_grad"], atol=ATOL, rtol=1e-5)
            torch.testing.assert_close(got["owned_grad"], expert_sum[got["owned_E"]], atol=ATOL, rtol=1e-5)
            stats = got["stats"]
            assert stats["replicas"] == added
            assert stats["gather_bytes"] == stats["reduce_bytes"] == added * stats["expert_bytes"]
            assert stats["expert_bytes"] == (3 if case["activation"] == "swiglu" else 2) * H * F * 4
        # Eq. 4 on the bytes each rank actually handed to the collectives.
        sent_gather = sum(results[r][ci]["stats"]["gather_bytes_sent_local"] for r in range(world))
        sent_reduce = sum(results[r][ci]["stats"]["reduce_bytes_sent_local"] for r in range(world))
        assert sent_gather == sent_reduce == added * results[0][ci]["stats"]["expert_bytes"]
        # Every rank saw the same rows-per-rank picture, and it counts every assignment once.
        rows = results[0][ci]["stats"]["tokens_per_rank"]
        assert all(results[r][ci]["stats"]["tokens_per_rank"] == rows for r in range(world))
        assert sum(rows) == K * sum(case["tokens"])
        owned = torch.cat([results[r][ci]["owned_E"] for r in range(world)])
        assert sorted(owned.tolist()) == list(range(E))
        assert torch.equal(owner_E[owned], torch.cat([torch.full_like(results[r][ci]["owned_E"], r)
                                                      for r in range(world)]))
