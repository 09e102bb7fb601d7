"""The chunked token exchange (moe/pipeline.py) with one copy per destination (moe/dedup.py) on 4
gloo ranks: one row per (token, destination) crosses in the chunks, each chunk's received rows
are expanded, computed and combined with their gate weights before the chunk returns.

* The sharded layer over 1 and 2 logical nodes (two hops, both chunked: ``moe/relay.py``; and one
  hop with ``hierarchical`` off), top-k 2 and 4 with experts crowded on few ranks (co-located
  picks), degrees (2, 3), (4, 1), (1, 3) and (3, 2), tiny token counts (empty and one-row chunks),
  re-materialization on two cases, activation checkpointing on two, a shared MLP per layer
  computed beside the exchange (``moe/side.py``) on two two-hop cases: outputs, input gradients,
  gate-weight gradients, owned expert gradients and the shared MLPs' gradients equal the
  single-process layer (fp32 tight), the shared MLPs computed once per forward, inside the exchange;
  the hidden-width rows that change rank in the forward are 2 x the hops' distinct (row,
  destination) pairs (dispatch and combine), fewer than one per assignment, and the layers'
  ``a2a_bytes_saved`` is the difference.
* The engine on 2 ranks, SGD, 3 steps, degrees {"forward": 3, "backward": 2}, one copy per
  destination and gradients in the gaps: losses and weights equal degree 1 (one FSSDP group of 2,
  and FSSDP groups of 1 with their EDP groups).
"""

import pytest
import torch

from distributed import spawn
from layer_cases import attach_shards, model_forward, rank_inputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks (about a minute)

H, F = 8, 12
WORLD = 4
CASES = [  # owners crowd experts on few ranks: a token often picks several experts of one rank
    dict(seed=1, E=8, K=2, owner=(0, 0, 0, 1, 1, 2, 2, 3), rpn=2, deg=(2, 3), tokens=(7, 5, 9, 3), act="gelu"),
    dict(seed=2, E=8, K=4, owner=(0, 0, 0, 0, 1, 1, 2, 3), rpn=4, deg=(4, 1), tokens=(1, 0, 2, 1), act="swiglu"),
    dict(seed=3, E=6, K=4, owner=(0, 1, 1, 2, 3, 3), rpn=2, deg=(4, 1), tokens=(6, 0, 11, 4), act="gelu",
         hierarchical=False),
    dict(seed=4, E=8, K=2, owner=(0, 0, 1, 1, 1, 2, 3, 3), rpn=2, deg=(2, 3), tokens=(9, 7, 3, 12), act="swiglu",
         layers=2, remat=True),
    dict(seed=5, E=8, K=4, owner=(0, 0, 0, 1, 2, 2, 3, 3), rpn=4, deg=(2, 3), tokens=(5, 8, 1, 2), act="gelu",
         layers=2, ckpt=True),
    # two hops, both chunked (moe/relay.py): empty and one-row chunks, forward degree 1, checkpointing
    dict(seed=6, E=8, K=4, owner=(0, 0, 0, 1, 1, 2, 3, 3), rpn=2, deg=(4, 1), tokens=(1, 0, 2, 1), act="swiglu",
         shared=True),
    dict(seed=7, E=8, K=2, owner=(0, 1, 1, 1, 2, 2, 3, 0), rpn=2, deg=(1, 3), tokens=(6, 9, 4, 7), act="gelu"),
    dict(seed=8, E=8, K=4, owner=(0, 0, 1, 1, 2, 2, 3, 3), rpn=2, deg=(3, 2), tokens=(5, 8, 1, 2), act="swiglu",
         layers=2, ckpt=True, remat=True, shared=True),
]
TOL = dict(atol=2e-6, rtol=1e-5)  # fp32: only the summation order of identical products differs


def make_layers(case):
    from ds_fssdp import FSSDPMoE
    torch.manual_seed(case["seed"])
    return [FSSDPMoE(hidden_size=H, ffn_hidden_size=F, num_experts=case["E"], k=case["K"], activation=case["act"],
                     init_std=0.3) for _ in range(case.get("layers", 1))]


def make_shared(case):
    """A shared MLP per layer for ``shared`` cases (None otherwise), the same on every rank."""
    if not case.get("shared"):
        return None
    torch.manual_seed(1000 + case["seed"])
    return [torch.nn.Sequential(torch.nn.Linear(H, 2 * F), torch.nn.GELU(), torch.nn.Linear(2 * F, H))
            for _ in range(case.get("layers", 1))]


def placement(case, world, layer):
    from ds_fssdp.planner import shard_placement
    gen = torch.Generator().manual_seed(100 * case["seed"] + layer)
    owner_E = torch.tensor(case["owner"])
    return owner_E, shard_placement(owner_E, world) | (torch.rand(case["E"], world, generator=gen) < 0.3)


class RowCounter:
    """Hidden-width rows this rank sends to other ranks through deepspeed.comm's all_to_all_single
    while installed (the exchanges of the forward; a relay hop's rows carry their K gate weights
    as more columns, H + K wide; the count all-gather and the last hop's gate weights, K wide,
    are not hidden-width)."""

    def __init__(self, rank, world, k):
        import deepspeed.comm as dist
        self.dist, self.rank, self.world, self.rows, self.k = dist, rank, world, 0, k
        self.orig = dist.all_to_all_single

    def __enter__(self):
        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            if input.dim() == 2 and input.shape[1] in (H, H + self.k) and input.is_floating_point():
                splits = list(input_split_sizes)
                self.rows += sum(splits) - (splits[self.rank] if len(splits) == self.world else 0)
            return self.orig(output, input, output_split_sizes=output_split_sizes,
                             input_split_sizes=input_split_sizes, group=group, **kw)
        self.dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        self.dist.all_to_all_single = self.orig


def _worker(rank, world, cases):
    from ds_fssdp import Topology
    from ds_fssdp.moe.dedup import DedupRoute
    from ds_fssdp.moe.sharded import ShardOptions
    from ds_fssdp.moe.side import SharedSide
    from ds_fssdp.runtime.groups import build_exchange_groups
    groups = {rpn: build_exchange_groups(world=world, rank=rank, group_size=world, ranks_per_node=rpn)
              for rpn in sorted({c["rpn"] for c in cases})}
    out = []
    for case in cases:
        layers = make_layers(case)
        options = ShardOptions(rematerialize=case.get("remat", False), one_copy_per_destination=True,
                               hierarchical=case.get("hierarchical", True), side=True)
        shards = attach_shards(layers, [placement(case, world, i) for i in range(len(layers))], rank=rank,
                               topo=Topology(num_ranks=world, ranks_per_node=case["rpn"]),
                               exchange=groups[case["rpn"]], degrees=case["deg"], options=options)
        shared, calls = make_shared(case), [0]
        for layer, mlp in zip(layers, shared or []):
            layer.side = SharedSide(mlp, 1.0)
            own = layer.side._forward
            layer.side._forward = lambda *a, own=own: calls.__setitem__(0, calls[0] + 1) or own(*a)
        x, dy = rank_inputs(case, rank, H)
        x.requires_grad_(True)
        with RowCounter(rank, world, case["K"]) as counter:
            y, l_aux = model_forward(layers, x, case.get("ckpt"), shared)
        routes = [s.records.current().iterations[-1].route for s in shards]
        assert all(isinstance(r, DedupRoute) for r in routes)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        for s in shards:
            s.accumulate_grads()
        sends = []  # per layer: (token, destination) of each assignment, from the per-assignment route
        for r in routes:
            dest = torch.repeat_interleave(torch.arange(world), torch.tensor(r.route.send_splits))
            sends.append(list(zip(r.route.send_token.tolist(), dest.tolist())))
        out.append(dict(y=y.detach(), x_grad=x.grad, gate_grads=[l.gate.weight.grad for l in layers],
                        owned=[(s.owned_E, s.master.grad.clone()) for s in shards], rows_sent=counter.rows,
                        sends=sends, hops=[len(r.hops) for r in routes],
                        staged=[r.hops[-1].stage_splits is not None for r in routes],
                        degrees=[(l.last_stats["pipeline_degree_fwd"], l.last_stats["pipeline_degree_bwd"])
                                 for l in layers],
                        saved=[l.last_stats["a2a_bytes_saved"] for l in layers],
                        shared_grads=[[p.grad for p in m.parameters()] for m in shared or []], shared_calls=calls[0],
                        side=[l.last_stats["side_overlapped"] for l in layers]))
    return out


def _reference(case, world):
    layers, shared = make_layers(case), make_shared(case)
    per_rank = []
    for rank in range(world):
        for layer in layers + (shared or []):
            layer.zero_grad()
        x, dy = rank_inputs(case, rank, H)
        x.requires_grad_(True)
        y, l_aux = model_forward(layers, x, False, shared)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        per_rank.append(dict(y=y.detach(), x_grad=x.grad, gate_grads=[l.gate.weight.grad.clone() for l in layers],
                             shared_grads=[[p.grad.clone() for p in m.parameters()] for m in shared or []],
                             expert_grads=[l.spec.flatten({n: getattr(l, n).grad for n in l.spec.names})
                                           for l in layers]))
    return per_rank, [torch.stack([r["expert_grads"][i] for r in per_rank]).sum(0) for i in range(len(layers))]


def _moved_rows(sends_by_rank, G, two_hops):
    """Rows that change rank, over the group, per assignment and under one copy per destination
    (one hop: distinct (token, destination); two hops: distinct (token, relay) to the relay with
    the sender's local index in the destination's node, then distinct (relay row, destination))."""
    per_assignment = sum(d != s for s, sends in enumerate(sends_by_rank) for _, d in sends)
    dedup = 0
    for s, sends in enumerate(sends_by_rank):
        pairs = set(sends)
        if not two_hops:
            dedup += sum(d != s for _, d in pairs)
            continue
        relay = lambda d: d // G * G + s % G  # noqa: E731
        dedup += len({(t, relay(d)) for t, d in pairs if relay(d) != s})
        dedup += sum(d != relay(d) for _, d in pairs)  # a relay row per (token, node), one row per final rank
    return per_assignment, dedup


def test_pipelined_one_copy_per_destination_matches_single_process():
    results = spawn(WORLD, _worker, CASES)
    fewer = 0
    for ci, case in enumerate(CASES):
        ref, sums = _reference(case, WORLD)
        two_hops = case.get("hierarchical", True) and 1 < case["rpn"] < WORLD
        moved_per_assignment, moved = 0, 0
        for layer in range(len(sums)):
            a, m = _moved_rows([results[r][ci]["sends"][layer] for r in range(WORLD)], case["rpn"], two_hops)
            moved_per_assignment, moved = moved_per_assignment + a, moved + m
        where = f"case {ci} (seed {case['seed']})"
        # dispatch + combine: each moved row crosses twice in the forward
        assert sum(results[r][ci]["rows_sent"] for r in range(WORLD)) == 2 * moved, where
        fewer += moved < moved_per_assignment
        # the layers' stats report what the chunks did not send (dispatch + combine, fp32 rows)
        assert sum(results[0][ci]["saved"]) == (moved_per_assignment - moved) * H * 4 * 2, where
        for rank in range(WORLD):
            got, want = results[rank][ci], ref[rank]
            where = f"case {ci} (seed {case['seed']}, degrees {case['deg']}) rank {rank}"
            assert got["hops"] == [2 if two_hops else 1] * len(sums), where
            assert got["staged"] == [two_hops] * len(sums), where  # both hops chunked (degrees are not (1, 1))
            assert got["degrees"] == [case["deg"]] * len(sums), where
            torch.testing.assert_close(got["y"], want["y"], **TOL, msg=where)
            torch.testing.assert_close(got["x_grad"], want["x_grad"], **TOL, msg=where)
            for g, w in zip(got["gate_grads"], want["gate_grads"]):
                torch.testing.assert_close(g, w, **TOL, msg=where)
            for (owned_E, grad), total in zip(got["owned"], sums):
                torch.testing.assert_close(grad, total[owned_E], **TOL, msg=where)
            if case.get("shared"):  # computed inside the exchange once per forward (again by the recompute)
                assert got["side"] == [1] * len(sums), where
                assert got["shared_calls"] == len(sums) * (2 if case.get("ckpt") else 1), where
                for gs, ws in zip(got["shared_grads"], want["shared_grads"]):
                    for g, w in zip(gs, ws):
                        torch.testing.assert_close(g, w, **TOL, msg=where)
            else:
                assert got["side"] == [0] * len(sums), where
    assert fewer >= 3, "the cases should send fewer rows than one per assignment"


def test_engine_pipelined_one_copy_per_destination_equals_degree_1():
    import training
    from training import ds_config
    world, steps = 2, 3
    base = {"ranks_per_node": 1, "one_copy_per_destination": True, "grads_in_gaps": True}
    d32 = {"forward": 3, "backward": 2}
    runs = {name: ds_config(world=world, zero=1, fssdp=dict(base, **extra))
            for name, extra in {"d1": {"pipeline_degree": 1}, "d32": {"pipeline_degree": d32},
                                "d32g1": {"pipeline_degree": d32, "group_size": 1}}.items()}
    res = spawn(world, training.train_worker, runs, steps)
    tight = dict(rtol=1e-5, atol=1e-6)  # fp32, SGD with momentum: summation order only
    for rank in range(world):
        ref = res[rank]["d1"]
        for name in ("d32", "d32g1"):
            got = res[rank][name]
            degrees = {(s["pipeline_degree_fwd"], s["pipeline_degree_bwd"]) for it in got["layer_stats"] for s in it}
            assert degrees == {(3, 2)}, (name, degrees)
            training.assert_same_training(got, ref, tol=tight, name=name)
        saved = [[s["a2a_bytes_saved"] for s in it] for it in res[rank]["d32"]["layer_stats"]]
        assert saved == [[s["a2a_bytes_saved"] for s in it] for it in ref["layer_stats"]]
        assert any(b > 0 for it in saved for b in it), saved  # rows were deduplicated in the chunks


def test_engine_two_hops_chunked_equal_degree_1():
    """4 ranks on 2 logical nodes (two hops; at degrees (3, 2) both chunked, ``moe/relay.py``),
    SGD, 3 steps, gradients in the gaps and re-materialization on: losses and weights equal
    degree 1 (the relay hop unchunked) in fp32."""
    import training
    from training import ds_config
    world, steps = 4, 3
    base = {"ranks_per_node": 2, "one_copy_per_destination": True, "grads_in_gaps": True, "rematerialize": True}
    runs = {name: ds_config(world=world, zero=1, fssdp=dict(base, pipeline_degree=deg))
            for name, deg in {"d1": 1, "d32": {"forward": 3, "backward": 2}}.items()}
    res = spawn(world, training.train_worker, runs, steps)
    tight = dict(rtol=1e-5, atol=1e-6)  # fp32, SGD with momentum: summation order only
    for rank in range(world):
        ref, got = res[rank]["d1"], res[rank]["d32"]
        degrees = {(s["pipeline_degree_fwd"], s["pipeline_degree_bwd"]) for it in got["layer_stats"] for s in it}
        assert degrees == {(3, 2)}, degrees
        training.assert_same_training(got, ref, tol=tight)
        saved = [s["a2a_bytes_saved_inter"] for it in got["layer_stats"] for s in it]
        assert saved == [s["a2a_bytes_saved_inter"] for it in ref["layer_stats"] for s in it]
        assert any(b > 0 for b in saved), saved  # tokens crossed to a node once
