"""One copy per destination (``fssdp.one_copy_per_destination``, moe/dedup.py) on gloo ranks: a token
crosses to a rank once, its rows are expanded there and returned as one gate-weighted row.

* 4 ranks as 2 logical nodes: the sharded layer with it off, on over one hop and on over two (to a
  relay in the destination's node, then inside it) equals the single-process layer (outputs,
  input, gate-weight and expert gradients), top-k 2 and 4 with experts crowded on few ranks, a rank
  with no tokens, a rank no one sends to; rows sent = distinct (token, destination) pairs (two
  hops: distinct (token, node) pairs first); the group's bytes saved, all links and across nodes.
* The engine on 2 ranks (2 logical nodes), SGD for several steps: on equals off and the single
  process, top-k 2 and 4, and with re-materialization under activation checkpointing; the bytes
  saved reach the metrics CSV.

The index math alone (no ranks): tests/test_dedup_tables.py.
"""
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.moe.dedup import DedupRoute
from test_dedup_tables import _pairs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks; > 30 s


H, F = 8, 12
LAYER_CASES = [  # owners crowd experts on few ranks, so tokens pick several experts on one rank
    dict(seed=1, E=8, K=2, activation="gelu", owner=(0, 0, 0, 1, 1, 2, 2, 3), replicas=0.3, tokens=(7, 0, 9, 5)),
    # rank 3 holds nothing: no rank sends to it
    dict(seed=2, E=8, K=4, activation="swiglu", owner=(0, 0, 0, 0, 0, 1, 1, 2), replicas=0.0, tokens=(12, 6, 3, 10)),
    dict(seed=3, E=6, K=4, activation="gelu", owner=(0, 1, 1, 2, 3, 3), replicas=0.4, tokens=(16, 16, 1, 16)),
]
LAYER_ATOL = 1e-6  # fp32: on and off differ only in the summation order of the top-k combine


def _layer(case):
    from ds_fssdp import FSSDPMoE
    torch.manual_seed(case["seed"])
    return FSSDPMoE(hidden_size=H, ffn_hidden_size=F, num_experts=case["E"], k=case["K"],
                    activation=case["activation"], z_loss_coef=0.01, init_std=0.3)


def _placement(case, world):
    from ds_fssdp.planner import shard_placement
    gen = torch.Generator().manual_seed(100 + case["seed"])
    owner_E = torch.tensor(case["owner"])
    placement_ED = shard_placement(owner_E, world) | (torch.rand(case["E"], world, generator=gen) < case["replicas"])
    if case["replicas"] == 0:
        placement_ED = shard_placement(owner_E, world)
    return owner_E, placement_ED


def _inputs(case, rank):
    gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    T = case["tokens"][rank]
    return torch.randn(T, H, generator=gen) * 2, torch.randn(T, H, generator=gen)


MODES = ("two-hops", "one-hop", "off")  # on (relays across the 2 nodes), on with one hop (hierarchical off), off


def _layer_worker(rank, world, cases):
    from ds_fssdp.moe.sharded import ShardedExperts, ShardOptions
    from ds_fssdp.planner import LoadPredictor
    out = []
    for case in cases:
        for mode in MODES:
            layer = _layer(case)
            owner_E, placement_ED = _placement(case, world)
            rows = layer.spec.flatten(layer.export_experts())[owner_E == rank]
            options = ShardOptions(one_copy_per_destination=mode != "off", hierarchical=mode != "one-hop")
            sharded = ShardedExperts(spec=layer.spec, layer_index=0, owner_E=owner_E, rows_SP=rows,
                                     topology=Topology(num_ranks=world, ranks_per_node=2), group=None,
                                     predictor=LoadPredictor(case["E"]), options=options)
            sharded.plan_placement = lambda ctx, p=placement_ED: (p, -1)
            layer.attach_sharded(sharded)
            x, dy = _inputs(case, rank)
            x.requires_grad_(True)
            y, l_aux, _ = layer(x)
            r = sharded.records.current().iterations[-1].route
            assert isinstance(r, DedupRoute) == (mode != "off")
            plain = r.route if mode != "off" else r
            pairs = _pairs(plain, x.shape[0])
            remote = sum(n for d, n in enumerate(plain.send_splits) if d != rank)
            other_node = sum(n for d, n in enumerate(plain.send_splits) if d // 2 != rank // 2)
            ((y * dy).sum() + 0.1 * l_aux).backward()
            sharded.accumulate_grads()
            out.append(dict(y=y.detach(), x_grad=x.grad, gate_grad=layer.gate.weight.grad,
                            owned_E=sharded.owned_E, owned_grad=sharded.master.grad.clone(), stats=layer.last_stats,
                            sent=[sum(h.splits) for h in r.hops] if mode != "off" else None,
                            pairs=len(pairs), node_pairs=len({(t, d // 2) for t, d in pairs}),
                            saved_rows=remote - sum(1 for _, d in pairs if d != rank),
                            saved_inter_rows=other_node - len({(t, d // 2) for t, d in pairs if d // 2 != rank // 2})))
    return out


def _layer_reference(case, world):
    layer = _layer(case)
    per_rank = []
    for rank in range(world):
        layer.zero_grad()
        x, dy = _inputs(case, rank)
        x.requires_grad_(True)
        y, l_aux, _ = layer(x)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        per_rank.append(dict(y=y.detach(), x_grad=x.grad, gate_grad=layer.gate.weight.grad.clone(),
                             expert_grads=layer.spec.flatten({n: getattr(layer, n).grad for n in layer.spec.names})))
    return per_rank, torch.stack([r["expert_grads"] for r in per_rank]).sum(0)


def test_sharded_layer_on_and_off_equal_the_single_process_layer():
    from distributed import spawn
    world = 4
    results = spawn(world, _layer_worker, LAYER_CASES)
    tol = dict(atol=LAYER_ATOL, rtol=1e-5)
    n = len(MODES)
    for ci, case in enumerate(LAYER_CASES):
        ref, expert_sum = _layer_reference(case, world)
        runs = {m: [results[r][n * ci + i] for r in range(world)] for i, m in enumerate(MODES)}
        on, one, off = runs["two-hops"], runs["one-hop"], runs["off"]
        for rank in range(world):
            for got in (on[rank], one[rank], off[rank]):
                torch.testing.assert_close(got["y"], ref[rank]["y"], **tol)
                torch.testing.assert_close(got["x_grad"], ref[rank]["x_grad"], **tol)
                torch.testing.assert_close(got["gate_grad"], ref[rank]["gate_grad"], **tol)
                torch.testing.assert_close(got["owned_grad"], expert_sum[got["owned_E"]], **tol)
            for key in ("y", "x_grad", "gate_grad", "owned_grad"):
                torch.testing.assert_close(on[rank][key], off[rank][key], **tol)
                torch.testing.assert_close(one[rank][key], off[rank][key], **tol)
            # The rows sent: one per distinct (token, destination); two hops: first one per
            # distinct (token, destination node).
            assert one[rank]["sent"] == [one[rank]["pairs"]]
            assert len(on[rank]["sent"]) == 2 and on[rank]["sent"][0] == on[rank]["node_pairs"]
            assert off[rank]["stats"]["a2a_bytes_saved"] == off[rank]["stats"]["a2a_meta_bytes"] == 0
        # The group's bytes saved (dispatch + combine), on every rank alike.
        row_bytes = H * 4 * 2
        saved_rows = sum(one[r]["saved_rows"] for r in range(world))
        saved_inter = sum(on[r]["saved_inter_rows"] for r in range(world))
        assert saved_rows > 0
        assert all(one[r]["stats"]["a2a_bytes_saved"] == saved_rows * row_bytes for r in range(world))
        assert all(on[r]["stats"]["a2a_bytes_saved_inter"] == saved_inter * row_bytes for r in range(world))
        assert on[0]["stats"]["a2a_bytes_saved_inter"] >= one[0]["stats"]["a2a_bytes_saved_inter"]
        assert on[0]["stats"]["a2a_bytes_intra"] == off[0]["stats"]["a2a_bytes_intra"]


ENGINE_WORLD, ENGINE_STEPS = 2, 3
ENGINE_TOL = dict(rtol=2e-5, atol=2e-6)


def _engine_runs(tmp):
    import os
    from training import ds_config

    def cfg(dedup, **extra):
        model = extra.pop("_model", {})
        c = ds_config(world=ENGINE_WORLD, zero=1, fssdp=dict({"ranks_per_node": 1, "one_copy_per_destination": dedup,
                                                                "metrics_csv": None}, **extra))
        return dict(c, _model=model) if model else c
    runs = {"on": cfg(True, metrics_csv=os.path.join(tmp, "on.csv")),
            "off": cfg(False, metrics_csv=os.path.join(tmp, "off.csv")),
            "on-k4": cfg(True, _model={"k": 4}),
            # Re-materialization under activation checkpointing (the recompute replays the route).
            "on-rm-ckpt": cfg(True, rematerialize=True, _model={"activation_checkpointing": "torch"})}
    return runs


def test_engine_sgd_steps_on_equal_off_and_the_single_process(tmp_path):
    import csv
    from distributed import spawn
    from training import assert_matches_reference, train_worker
    runs = _engine_runs(str(tmp_path))
    trained = spawn(ENGINE_WORLD, train_worker, runs, ENGINE_STEPS)
    for on, off in (("on", "off"), ("on-rm-ckpt", "off")):
        for res in trained:
            a, b = res[on], res[off]
            torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **ENGINE_TOL)
            torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), **ENGINE_TOL)
            for n, p in a["dense"].items():
                torch.testing.assert_close(p, b["dense"][n], **ENGINE_TOL)
            for la, lb in zip(a["experts"], b["experts"]):
                for n in la:
                    torch.testing.assert_close(la[n], lb[n], **ENGINE_TOL)
    assert sum(trained[0]["on-rm-ckpt"]["replicas"]) > 0
    for name in ("on", "on-k4", "on-rm-ckpt"):
        assert_matches_reference([r[name] for r in trained], runs[name], world=ENGINE_WORLD, steps=ENGINE_STEPS,
                                 tol=ENGINE_TOL, name=name)
    # The bytes saved reach the metrics CSV (0 with it off).
    for name, positive in (("on", True), ("off", False)):
        with open(tmp_path / f"{name}.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == ENGINE_STEPS
        saved = [float(row[f"layer{l}/a2a_bytes_saved"]) for row in rows for l in range(2)]
        meta = [float(row[f"layer{l}/a2a_meta_bytes"]) for row in rows for l in range(2)]
        if positive:  # rows left their rank every step; some steps had two picks on one remote rank
            assert sum(saved) > 0 and all(m > 0 for m in meta), (saved, meta)
        else:
            assert all(v == 0 for v in saved + meta), (saved, meta)
