"""The simulators' ZeRO stages (ds_fssdp/sim/sync.py, sim/memory.py): the sync split into what
lands before the step and what is gathered after it, the wait of a gather drained before per-layer
deadlines against a step-by-step replay, the partitioned optimizer state in memory and the cap's
budget, and the cluster engine charging each schedule what it runs (EP's gathers at the step,
FSSDP's experts' gather in the next forward), the bound staying below every policy; bad stages are
refused by name."""
import dataclasses
import io
import json

import numpy as np
import pytest

from ds_fssdp import Topology
from ds_fssdp.planner import ExpertShape, Hardware
from ds_fssdp.planner.schedule import drain_before_deadlines, drain_in_gaps, split_sync_pays
from ds_fssdp.sim.__main__ import main
from ds_fssdp.sim.bound import LowerBound
from ds_fssdp.sim.cluster import PolicyRun, simulate_cluster
from ds_fssdp.sim.links import allreduce_links
from ds_fssdp.sim.memory import budget_for_cap, ep_memory_bytes, optimizer_params
from ds_fssdp.sim.pipeline import ScheduleOptions
from ds_fssdp.planner.prices import allreduce_share, reduce_scatter_share
from ds_fssdp.planner.sync_dtype import expert_sync_bytes
from ds_fssdp.sim.setup import OPT_BYTES, PARAM_BYTES, Setup, derive_overlap_degree
from ds_fssdp.sim.sync import dense_sync, expert_inputs, exposed_sync, sync_times
from ds_fssdp.sim.synth import synthetic_trace

SHAPE = ExpertShape(hidden=512, ffn=2048)
HW = Hardware(flops=100e12, intra_bw=200e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12)


def setup_with(zero_stage=0, *, ranks=8, ranks_per_node=2, layers=4, hw=HW) -> Setup:
    topo = Topology(num_ranks=ranks, ranks_per_node=ranks_per_node)
    tokens, d = 8192, 512
    flops = 8.0 * d * d + 2.0 * 1024 * d
    return Setup(topology=topo, hw=hw, shape=SHAPE, num_layers=layers, num_experts=16, tokens_per_gpu=tokens,
                 attention_flops_per_token=flops, dense_params=2 * 4 * d * d,
                 overlap_degree=derive_overlap_degree(hw, topo, SHAPE, attention_s=tokens * flops / hw.flops),
                 budget=3, budget_rm=6, flexmoe_slots=1, reshard_interval=0, top_k=2, calibration=False,
                 zero_stage=zero_stage)


def replay_deadlines(work, gaps, lead):
    """Event by event: before step j every piece due by then (a prefix: deadlines grow with i) has
    arrived, the pass waiting while the link drains the queue's front; then step j runs and its
    gap drains the queue."""
    queue, waited = list(work), 0.0

    def drain(seconds):
        for i in range(len(queue)):
            take = min(queue[i], seconds)
            queue[i] -= take
            seconds -= take

    for j, gap in enumerate(gaps):
        due = [i for i in range(len(work)) if max(0, i - lead) <= j]
        need = sum(queue[:due[-1] + 1]) if due else 0.0
        waited += need
        drain(need)
        drain(max(0.0, gap))
    return waited


def test_drain_before_deadlines_known_answers_and_replay():
    assert drain_before_deadlines([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]) == pytest.approx(2.0)
    assert drain_before_deadlines([1.0, 1.0, 1.0], [5.0, 5.0, 5.0]) == pytest.approx(1.0)  # only the first waits
    assert drain_before_deadlines([1.0, 1.0, 1.0], [5.0, 5.0, 5.0], lead=1) == pytest.approx(2.0)
    assert drain_before_deadlines([0.0, 0.0], [1.0, -3.0]) == 0.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        L = int(rng.integers(1, 7))
        work, gaps = rng.uniform(0, 1, L), rng.uniform(-0.2, 1.5, L)
        lead = int(rng.integers(0, 3))
        assert drain_before_deadlines(list(work), list(gaps), lead=lead) == pytest.approx(
            replay_deadlines(list(work), list(gaps), lead), abs=1e-12)
    with pytest.raises(ValueError, match="one entry per layer"):
        drain_before_deadlines([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"lead \(-1\)"):
        drain_before_deadlines([1.0], [1.0], lead=-1)


def ring_s(setup, members, sizes, share=allreduce_share):
    return float(allreduce_links(members, np.asarray(sizes, dtype=np.float64),
                                 ranks_per_node=setup.topology.ranks_per_node, share=share).time_B(setup.hw)[0])


@pytest.mark.parametrize("comm,grad_bytes", [(None, 2), ("fp32", 4)])
def test_sync_is_deepspeeds_dense_part_and_the_runtimes_experts_part(comm, grad_bytes):
    """DeepSpeed's dense collectives (an all-reduce at ZeRO 0; a reduce-scatter and the parameters'
    all-gather at ZeRO 1) apart from the experts' (the gradients over the EDP rings: all-reduced at
    ZeRO 0, reduce-scattered at ZeRO 1 and the stepped rows all-gathered in their dtype), the
    gradients in DeepSpeed's communication dtype (bf16 by default, fp32 when configured), every
    collective priced with the price list's ring shares."""
    z0, z1 = (dataclasses.replace(setup_with(z), communication_data_type=comm) for z in (0, 1))
    N, D = 4, 8
    assert z0.grad_sync_bytes == grad_bytes
    owned_N = np.array([10.0, 6.0, 8.0, 8.0])
    dense_M, edp_M = np.ones((1, D), dtype=bool), np.tile(np.eye(N, dtype=bool), (1, D // N))
    dense_K, grads_K = [z0.dense_params * grad_bytes], owned_N * z0.shape.params * grad_bytes
    s0 = sync_times(z0, N, owned_N)
    assert dense_sync(z0) == s0.step_gather_s == pytest.approx(ring_s(z0, dense_M, dense_K))
    assert (s0.reduce_s, s0.forward_gather_s) == (pytest.approx(ring_s(z0, edp_M, grads_K)), 0.0)
    s1 = sync_times(z1, N, owned_N)
    assert s1.step_gather_s == pytest.approx(ring_s(z1, dense_M, dense_K, reduce_scatter_share)
                                             + ring_s(z1, dense_M, [z1.dense_params * PARAM_BYTES],
                                                      reduce_scatter_share))
    assert s1.reduce_s == pytest.approx(ring_s(z1, edp_M, grads_K, reduce_scatter_share))
    assert s1.forward_gather_s == pytest.approx(ring_s(z1, edp_M, owned_N * z1.shape.params * PARAM_BYTES,
                                                       reduce_scatter_share))
    lat = z1.hw.latency
    assert s1.reduce_s - lat == pytest.approx((s0.reduce_s - lat) / 2)  # a reduce-scatter: half the ring's bytes
    # the same bytes over every link at ZeRO 1 as at ZeRO 0 but what the gathers' bf16 (rows, dense
    # parameters) saves against fp32 gradients: nothing in bf16
    saved = grad_bytes - PARAM_BYTES
    gathered = allreduce_links(edp_M, owned_N * z1.shape.params * saved, ranks_per_node=2, share=reduce_scatter_share)
    dense = allreduce_links(dense_M, [z1.dense_params * saved], ranks_per_node=2, share=reduce_scatter_share)
    np.testing.assert_allclose(s1.links.node_Bn + gathered.node_Bn + dense.node_Bn, s0.links.node_Bn)
    one = sync_times(z1, D)  # one group: nothing to sync over an EDP group, only the dense part
    assert (one.reduce_s, one.forward_gather_s) == (0.0, 0.0) and one.step_gather_s == pytest.approx(dense_sync(z1))
    even = sync_times(z1, N)  # even owners: E L / N each
    assert even.reduce_s == pytest.approx(ring_s(z1, edp_M, np.full(N, 16 * 4 / N) * z1.shape.params * grad_bytes,
                                                 reduce_scatter_share))


def test_zero_0_split_is_the_experts_reduce_scatter_and_all_gather():
    z0 = setup_with(0)
    N, D = 4, 8
    edp_M = np.tile(np.eye(N, dtype=bool), (1, D // N))
    grads_K = np.full(N, 16 * 4 / N) * z0.shape.params * z0.grad_sync_bytes
    s = sync_times(z0, N, split_experts=True)
    half = ring_s(z0, edp_M, grads_K, reduce_scatter_share)
    assert (s.reduce_s, s.forward_gather_s) == (pytest.approx(half), pytest.approx(half))  # the summed gradient
    assert s.step_gather_s == pytest.approx(dense_sync(z0)) and s.reduce_s < sync_times(z0, N).reduce_s
    one = sync_times(z0, D, split_experts=True)  # one group: no experts' sync to split
    assert (one.forward_gather_s, one.reduce_s) == (0.0, 0.0)


def test_split_sync_pays_known_answers():
    L = 4
    # backward gaps that hide the whole all-reduce: splitting only exposes the gather's first layers
    assert not split_sync_pays([1.0] * L, [0.5] * L, [0.5] * L, [10.0] * L, [10.0] * L, lead=1)
    # no backward gaps: whole, the all-reduce is exposed (4.0); split, its reduce-scatter (2.0) and
    # what the forward cannot hide before the deadlines (lead 1: the first two layers', 1.0)
    assert drain_in_gaps([0.5] * L, [0.0] * L) + drain_before_deadlines([0.5] * L, [10.0] * L, lead=1) == 3.0
    assert split_sync_pays([1.0] * L, [0.5] * L, [0.5] * L, [0.0] * L, [10.0] * L, lead=1)
    # and no forward gaps either: split exposes 2.0 + 2.0, not less than whole's 4.0
    assert not split_sync_pays([1.0] * L, [0.5] * L, [0.5] * L, [0.0] * L, [0.0] * L, lead=1)


def test_exposed_sync_serial_and_in_the_gaps():
    """The dense part whole; the experts' at the step layer after layer (serial), or drained in the
    gaps (split_sync_exposed: the all-reduce alone, or its reduce-scatter and all-gather when split)."""
    L, dense = 4, 0.25
    experts = ([1e-3] * L, [5e-4] * L, [4e-4] * L, [2e-4] * L, [3e-4] * L)
    allreduce_L, reduce_L, gather_L, bgaps, fgaps = experts
    assert exposed_sync(dense, None, gaps=True, split=True, lead=1) == dense  # one group
    assert exposed_sync(dense, experts, gaps=False, split=False, lead=0) == pytest.approx(dense + 4e-3)
    assert exposed_sync(dense, experts, gaps=False, split=True, lead=0) == pytest.approx(dense + 4 * 9e-4)
    assert exposed_sync(dense, experts, gaps=True, split=False, lead=1) == pytest.approx(dense + 4e-3 - 3 * 2e-4)
    for lead in (0, 1):
        gapped = exposed_sync(dense, experts, gaps=True, split=True, lead=lead)
        expect = dense + (2e-3 - 3 * 2e-4) + drain_before_deadlines(gather_L, fgaps, lead=lead)
        assert gapped == pytest.approx(expect)


def test_partitioned_optimizer_state_in_memory_and_the_caps_budget():
    z0, z1 = setup_with(0), setup_with(1)
    owned = 1000.0
    assert optimizer_params(z0, owned, 4) == z0.dense_params + owned
    assert optimizer_params(z1, owned, 4) == pytest.approx(z1.dense_params / 8 + owned / 2)
    assert optimizer_params(z1, owned, 8) == pytest.approx(z1.dense_params / 8 + owned)  # one group: experts whole
    for N in (4, 8):
        own = 16 // N * 4 * z0.shape.params
        saved = OPT_BYTES * (optimizer_params(z0, own, N) - optimizer_params(z1, own, N))
        assert ep_memory_bytes(z0, N) - ep_memory_bytes(z1, N) == pytest.approx(saved) and saved > 0
    assert budget_for_cap(z1, 4, 1.5, rematerialize=False) < budget_for_cap(z0, 4, 1.5, rematerialize=False)


def recording(calls):
    """``cluster.exposed_sync`` that records each step's charge with its inputs."""
    def recorded(dense_s, experts, **kw):
        value = exposed_sync(dense_s, experts, **kw)
        calls.append((dense_s, experts, kw, value))
        return value
    return recorded


@pytest.fixture(scope="module")
def runs():
    """Both stages, every policy; each step's sync charge is recorded with its inputs."""
    import ds_fssdp.sim.cluster as cluster
    out, calls = {}, []
    for z in (0, 1):
        setup = setup_with(z)
        tokens = synthetic_trace(steps=9, num_layers=setup.num_layers, num_experts=16, num_ranks=8,
                                 assignments_per_rank=2 * setup.tokens_per_gpu, target_std=0.12, top_k=2,
                                 seed=1).tokens_SLED
        out[z] = {}
        for name in ("ep", "fsmoe", "fssdp", "fssdp-rm"):
            calls.clear()
            cluster.exposed_sync, original = recording(calls), cluster.exposed_sync
            try:
                r, = simulate_cluster(setup, tokens, [name], group_size=4, memory_cap=1.5)
            finally:
                cluster.exposed_sync = original
            out[z][name] = (r, list(calls[setup.load_window:]))  # the timed steps'
    return out


@pytest.mark.parametrize("comm", [None, "fp32"])
def test_the_bound_syncs_in_the_communication_dtype(comm):
    """The bound's ways to sync are every policy's, DeepSpeed's MoE's too, in the communication
    dtype the runs are charged in (no bf16 copy for EP under fp32: it would loosen the bound)."""
    for zero in (0, 1):
        setup = dataclasses.replace(setup_with(zero), communication_data_type=comm)
        kinds = (False, True) if zero == 0 else (False, )
        seconds = [(t.step_gather_s, t.reduce_s, t.forward_gather_s) for t in
                   LowerBound(setup, group_size=4, budget=3).syncs]
        assert seconds == [(t.step_gather_s, t.reduce_s, t.forward_gather_s) for t in
                           (sync_times(setup, 4, split_experts=k) for k in kinds)]


def test_zero_1_charges_each_schedule_what_it_runs(runs):
    """EP reduces and gathers at the step, whole; fsmoe and FSSDP gather their experts in the next
    forward's gaps, before each layer's first use (FSSDP's a layer ahead: its replica gather), which
    hides part of it; DeepSpeed's dense part whole for all; what each step is charged is that; the
    optimizer steps slices, the memory shrinks and stays within the cap, the bound below."""
    z0, z1 = runs[0], runs[1]
    for name, (r, calls) in z1.items():
        assert len(calls) == 4
        assert r.breakdown_s["ar"] == pytest.approx(np.mean([v for *_, v in calls]))
        for dense_s, experts, kw, value in calls:
            assert kw["split"]
            if name == "ep":  # DeepSpeed's MoE: its engine's experts' sync (bf16 here) after the dense one, whole
                whole = sync_times(setup_with(1), 4, np.full(4, 16.0))
                assert experts is None and not kw["gaps"]
                assert value == pytest.approx(whole.step_gather_s + whole.reduce_s + whole.forward_gather_s)
                assert whole.step_gather_s == pytest.approx(dense_sync(setup_with(1))) and value > whole.step_gather_s
                continue
            assert dense_s == pytest.approx(dense_sync(setup_with(1)))
            allreduce_L, reduce_L, gather_L, _, fgaps = experts
            assert kw["gaps"] and kw["lead"] == (0 if name == "fsmoe" else 1)
            assert min(fgaps) > 0
            at_the_step = exposed_sync(dense_s, experts[:4] + ([0.0] * len(fgaps), ), **kw)
            assert value < at_the_step - 1e-9, name
        assert r.breakdown_s["opt"] < z0[name][0].breakdown_s["opt"], name  # the optimizer steps slices
        assert sum(r.memory_bytes.values()) <= 1.5 * r.ep_memory_bytes * (1 + 1e-9), name
        assert r.ep_memory_bytes < z0[name][0].ep_memory_bytes
        assert 0 < r.lower_bound_s <= r.iteration_s, (name, r.lower_bound_s, r.iteration_s)
    for name, (r, calls) in z0.items():  # ZeRO 0: EP and fsmoe all-reduce before the step
        if name in ("ep", "fsmoe"):
            assert not any(kw["split"] for _, _, kw, _ in calls)


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("hw", [HW, dataclasses.replace(HW, inter_bw=50e9, intra_bw=20e9)], ids=["slow-node", "slow-gpu"])
def test_bound_is_below_every_policy_with_expert_data_parallelism(hw, zero):
    """Both ZeRO stages, with EDP groups (groups of 4) and without (8): at ZeRO 0 the bound is the
    least over the all-reduce before the step and its experts' part split around it (FSSDP's)."""
    setup = setup_with(zero, hw=hw, ranks_per_node=4)
    tokens = synthetic_trace(steps=9, num_layers=setup.num_layers, num_experts=16, num_ranks=8,
                             assignments_per_rank=2 * setup.tokens_per_gpu, target_std=0.12, top_k=2,
                             seed=2).tokens_SLED
    for group in (4, 8):
        for r in simulate_cluster(setup, tokens, ["ep", "uniform", "fsmoe", "fssdp", "fssdp-rm"], group_size=group):
            assert 0 < r.lower_bound_s <= r.iteration_s, (group, r.policy, r.lower_bound_s, r.iteration_s)


def test_bad_stages_are_refused_by_name():
    with pytest.raises(ValueError, match=r"zero_stage \(2\) must be 0 or 1"):
        setup_with(2)
    tokens = np.ones((7, 4, 16, 8), dtype=np.int64)
    with pytest.raises(ValueError, match=r"flexmoe at group_size \(8\) and zero_stage \(1\): the paper's baselines"):
        PolicyRun("flexmoe", setup_with(1))
    with pytest.raises(SystemExit, match=r"--zero-stage \(3\) must be one of"):
        main(["--trace", "synthetic", "--cluster", "b", "--model", "qwen3-30b-a3b", "--gpus", "16", "--group-size",
              "8", "--steps", "6", "--zero-stage", "3", "--json", "--no-png"], out=io.StringIO())
    with pytest.raises(SystemExit, match=r"--zero-stage \(1\): modelled at cluster scale only"):
        main(["--trace", "synthetic", "--cluster", "a", "--model", "gpt-s-moe", "--gpus", "8", "--steps", "6",
              "--zero-stage", "1", "--json", "--no-png"], out=io.StringIO())


def test_the_cli_reports_the_stage():
    out = io.StringIO()
    main(["--trace", "synthetic", "--cluster", "b", "--model", "qwen3-30b-a3b", "--gpus", "16", "--group-size", "8",
          "--steps", "6", "--zero-stage", "1", "--policies", "ep,fssdp", "--json", "--no-png"], out=out)
    data = json.loads(out.getvalue())
    assert data["setup"]["zero_stage"] == 1
    assert {r["policy"] for r in data["results"]} == {"ep", "fssdp"}


@pytest.mark.parametrize("inter_bw,splits", [(5e9, True), (400e9, False)], ids=["slow-node-link", "fast-node-link"])
def test_zero_0_splits_the_experts_sync_where_it_pays(inter_bw, splits):
    """ZeRO 0 under FSSDP with the gaps: after each step the experts' all-reduce of the next is
    split around the step (its all-gather of the summed gradients in the next forward) where
    ``split_sync_pays`` says so on that step's gaps (the runtime's rule): where the node link is
    the step's (slow), every step after the first splits and exposes less than the all-reduce in
    the same gaps; where the backward's gaps hide the all-reduce (fast), none does."""
    import ds_fssdp.sim.cluster as cluster
    setup = setup_with(0, hw=dataclasses.replace(HW, inter_bw=inter_bw))
    tokens = synthetic_trace(steps=9, num_layers=setup.num_layers, num_experts=16, num_ranks=8,
                             assignments_per_rank=2 * setup.tokens_per_gpu, target_std=0.12, top_k=2,
                             seed=1).tokens_SLED
    calls = []
    cluster.exposed_sync, original = recording(calls), cluster.exposed_sync
    try:
        r, = simulate_cluster(setup, tokens, ["fssdp"], group_size=4)
    finally:
        cluster.exposed_sync = original
    L = setup.num_layers
    owner_LE = np.tile(np.arange(16) % 4, (L, 1))  # homogeneous owners, no re-shard
    taken = [kw["split"] for _, _, kw, _ in calls]
    decided = [split_sync_pays(*expert_inputs(setup, 4, owner_LE, experts[3], experts[4]), lead=1)
               for _, experts, _, _ in calls]
    assert taken[0] is False  # nothing decided before the first step
    assert taken[1:] == decided[:-1]  # each step as decided after the one before
    assert all(t == splits for t in taken[1:]), taken
    assert r.split_steps == (1.0 if splits else 0.0)
    for dense_s, experts, kw, value in calls[1:]:
        whole = exposed_sync(dense_s, experts, **dict(kw, split=False))
        assert value == pytest.approx(exposed_sync(dense_s, experts, **dict(kw, split=splits)))
        if splits:
            assert value < whole


def test_runtime_and_simulator_build_the_split_inputs_in_one_place(monkeypatch):
    """The split decision's inputs come from ``planner.schedule.split_sync_inputs`` for the runtime
    (``EDPSyncPlan.split_inputs``) and the cluster simulator (``sim.sync.expert_inputs``: its decision and its
    charge) alike, and
    for the same situation (uneven owners: layer i's reduce is its busiest owner's gradient; the same
    gaps, each layer's at the degrees it ran at; the same EDP ring) they are equal: the experts'
    gradient in the runtime's communication dtype under bf16 training with DeepSpeed's default
    (``engine_comm_dtype``: bf16), the dense gradients not in it. A caller building its own inputs
    is not recorded and fails."""
    from types import SimpleNamespace

    import torch

    import ds_fssdp.runtime.edp_sync as edp_sync
    import ds_fssdp.sim.sync as sim_sync
    from ds_fssdp.planner.schedule import split_sync_inputs
    from ds_fssdp.runtime.expert_dp import engine_comm_dtype
    calls = []

    def recorded(*args, **kw):
        calls.append(split_sync_inputs(*args, **kw))
        return calls[-1]

    monkeypatch.setattr(edp_sync, "split_sync_inputs", recorded)
    monkeypatch.setattr(sim_sync, "split_sync_inputs", recorded)
    setup, N, L = setup_with(0, ranks=8, ranks_per_node=2, layers=3), 4, 3
    n = 8 // N  # the EDP group
    uneven_E = np.r_[np.zeros(7, dtype=np.int64), np.arange(9) % 4]  # rank 0 owns 10 experts
    owner_LE = np.array([np.arange(16) % 4, uneven_E, np.arange(16) // 4])
    owned_L = [int(np.bincount(o, minlength=N).max()) for o in owner_LE]
    assert owned_L == [4, 10, 4]
    attention, idle = [1e-3, 2e-3, 3e-3], {(True, 3): 5e-4, (False, 2): 7e-4}
    backward_L = [2.0 * a + idle[True, 3] for a in attention]
    forward_L = [a + idle[False, 2] for a in attention]

    def ring(nbytes):
        members = np.tile(np.eye(N, dtype=bool), (1, n))
        return float(allreduce_links(members, np.full(N, float(nbytes)), ranks_per_node=2).time_B(setup.hw)[0])

    simulated = expert_inputs(setup, N, owner_LE, backward_L, forward_L)
    # the runtime: the same ring as its cost model (a reduce-scatter priced per rank's slice) and gaps
    cost = SimpleNamespace(edp_reduce_linear=lambda size, partitioned: (lambda b: ring(b * size / 2.0))
                           if partitioned else ring)
    monkeypatch.setattr(edp_sync, "idle_link_s", lambda costs, load, degree, backward: idle[backward, degree])
    shards = [SimpleNamespace(rows=torch.zeros(k * setup.shape.params, dtype=torch.bfloat16)) for k in owned_L]
    comm = engine_comm_dtype(deepspeed_engine_like({}, torch.bfloat16), torch.bfloat16)
    plan = edp_sync.EDPSyncPlan(shards, edp_group=None, edp_size=n, grads_in_gaps=True, cost=cost,
                                partitioned=False, optimizer=None, ranks_per_node=2, grad_bytes=comm.itemsize)
    plan.loads, plan.degrees = [object()] * L, [(2, 3)] * L
    runtime = plan.split_inputs(attention_s=attention, schedule_costs=object())
    assert len(calls) == 2 and calls == [simulated, runtime]
    assert runtime == simulated
    allreduce_L, scatter_L, gather_L, back, fwd = runtime
    assert allreduce_L == [ring(2.0 * k * setup.shape.params) for k in owned_L]  # bf16, no dense gradients
    assert scatter_L == gather_L == [ring(1.0 * k * setup.shape.params) for k in owned_L]
    assert back == backward_L and fwd == forward_L


@pytest.mark.parametrize("zero", [0, 1])
def test_the_sync_charge_is_built_from_the_runtimes_split_inputs(zero, monkeypatch):
    """Every step's sync charge (cluster engine, FSSDP with the gaps) is DeepSpeed's dense part plus
    the experts' part from ``planner.schedule.split_sync_inputs`` on the runtime's inputs: each
    layer's busiest owner's gradient over the EDP rings in the communication dtype (bf16: DeepSpeed's
    default under bf16 training; at ZeRO 1 the stepped rows gathered in their dtype), that step's
    gaps, priced with the price list's ring shares, built here again: equal. Negative control: the
    simulator's gradient bytes drifted to fp32, and they differ."""
    import ds_fssdp.sim.cluster as cluster
    import ds_fssdp.sim.sync as sim_sync
    from ds_fssdp.planner.schedule import split_sync_exposed, split_sync_inputs
    setup = setup_with(zero)
    tokens = synthetic_trace(steps=8, num_layers=setup.num_layers, num_experts=16, num_ranks=8,
                             assignments_per_rank=2 * setup.tokens_per_gpu, target_std=0.12, top_k=2,
                             seed=4).tokens_SLED
    edp_M = np.tile(np.eye(4, dtype=bool), (1, 2))
    elems_L = [16 // 4 * setup.shape.params] * setup.num_layers  # homogeneous owners (no re-shard)

    def here(experts):
        return split_sync_inputs(elems_L, expert_sync_bytes(None, training="bf16"), experts[3], experts[4],
                                 allreduce=lambda b: ring_s(setup, edp_M, np.full(4, b)),
                                 reduce_scatter=lambda b: ring_s(setup, edp_M, np.full(4, b), reduce_scatter_share),
                                 gather_bytes=2 if zero else None)

    def charged_from_the_runtimes_inputs() -> bool:
        calls = []
        monkeypatch.setattr(cluster, "exposed_sync", recording(calls))
        simulate_cluster(setup, tokens, ["fssdp"], group_size=4)
        assert len(calls) == 8
        agree = True
        for dense_s, experts, kw, value in calls:
            want = here(experts)
            agree &= all(np.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(experts, want))
            work, gather = (want[1], want[2]) if kw["split"] else (want[0], [0.0] * len(want[0]))
            agree &= value == pytest.approx(dense_sync(setup) + split_sync_exposed(work, gather, want[3], want[4],
                                                                                   lead=1), rel=1e-12)
        return agree

    assert charged_from_the_runtimes_inputs()
    monkeypatch.setattr(Setup, "grad_sync_bytes", property(lambda self: 4))
    assert not charged_from_the_runtimes_inputs()


def deepspeed_engine_like(ds_config: dict, training, *, sequence_parallel: int = 1):
    """What ``runtime.expert_dp.engine_comm_dtype`` reads of a DeepSpeed engine training in
    ``training`` with ``ds_config``: its parsed config and its ``communication_data_type``, from
    DeepSpeed's own parser and property (``deepspeed/runtime/config.py``, ``engine.py``)."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.runtime.engine import DeepSpeedEngine
    engine = SimpleNamespace(_config=SimpleNamespace(_param_dict=ds_config,
                                                     communication_data_type=get_communication_data_type(ds_config)),
                             fp16_enabled=lambda: training == torch.float16,
                             bfloat16_enabled=lambda: training == torch.bfloat16,
                             sequence_parallel_size=sequence_parallel)
    engine.communication_data_type = DeepSpeedEngine.communication_data_type.fget(engine)
    return engine


COMM_CASES = [  # (DeepSpeed config, training dtype, the sync's dtype)
    ({}, "bf16", "bf16"), ({"communication_data_type": "fp32"}, "bf16", "fp32"),
    ({"communication_data_type": "FP16"}, "bf16", "fp16"), ({"communication_data_type": None}, "bf16", "bf16"),
    ({}, "fp32", "fp32"), ({}, "fp16", "fp16"), ({"communication_data_type": "bf16"}, "fp32", "bf16"),
]


@pytest.mark.parametrize("ds_config,training,want", COMM_CASES)
def test_the_runtimes_sync_dtype_and_the_simulators_bytes_are_one_function(ds_config, training, want):
    """``planner.sync_dtype.expert_sync_dtype`` gives the runtime's dtype (``engine_comm_dtype``,
    what ``runtime/expert_dp.py`` sends and ``EDPSyncPlan`` counts bytes in), equal to DeepSpeed's own
    ``engine.communication_data_type`` for the config, and the bytes the simulators charge
    (``Setup.grad_sync_bytes`` under the bf16 training they model, ``expert_inputs``' rings)."""
    from ds_fssdp.runtime.expert_dp import DTYPES, engine_comm_dtype
    engine = deepspeed_engine_like(ds_config, DTYPES[training])
    comm = engine_comm_dtype(engine, DTYPES[training])
    assert comm == DTYPES[want] == engine.communication_data_type
    assert comm.itemsize == expert_sync_bytes(ds_config, training=training)
    if training == "bf16":
        setup = dataclasses.replace(setup_with(0), communication_data_type=ds_config.get("communication_data_type"))
        assert setup.grad_sync_bytes == comm.itemsize
        owner_LE = np.tile(np.arange(16) % 4, (setup.num_layers, 1))
        allreduce_L = expert_inputs(setup, 4, owner_LE, [0.0] * setup.num_layers, [0.0] * setup.num_layers)[0]
        edp_M = np.tile(np.eye(4, dtype=bool), (1, 2))
        assert allreduce_L == [pytest.approx(ring_s(setup, edp_M, np.full(4, 4.0 * setup.shape.params * comm.itemsize)))
                               ] * setup.num_layers


def test_ulysses_sp_and_a_drifted_deepspeed():
    """Under Ulysses SP DeepSpeed's engine sends ``seq_parallel_communication_data_type`` (fp32 by
    default), and so do the experts; an engine whose dtype differs from the function's is refused
    by name (negative control)."""
    import torch

    from ds_fssdp.runtime.expert_dp import engine_comm_dtype
    engine = deepspeed_engine_like({}, torch.bfloat16, sequence_parallel=2)
    engine.communication_data_type = torch.float32  # what DeepSpeed sets under SP (engine.py)
    assert engine_comm_dtype(engine, torch.bfloat16) == torch.float32
    assert expert_sync_bytes({}, training="bf16", sequence_parallel=True) == 4
    drifted = deepspeed_engine_like({}, torch.bfloat16)
    drifted.communication_data_type = torch.float16
    with pytest.raises(RuntimeError, match=r"would send bf16 \(communication_data_type\), DeepSpeed's engine sends"):
        engine_comm_dtype(drifted, torch.bfloat16)


def test_bad_communication_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^communication_data_type \('int8'\) must be one of 'fp32', 'bf16', 'fp16'"):
        expert_sync_bytes({"communication_data_type": "int8"}, training="bf16")
    with pytest.raises(ValueError, match=r"^communication_data_type \('fp8'\) must be one of"):
        dataclasses.replace(setup_with(0), communication_data_type="fp8")
    with pytest.raises(ValueError, match=r"^training \('int8'\) must be one of"):
        expert_sync_bytes({}, training="int8")
    with pytest.raises(SystemExit):
        main(["--trace", "synthetic", "--cluster", "b", "--model", "qwen3-30b-a3b", "--gpus", "16", "--group-size",
              "8", "--communication-data-type", "fp8", "--json", "--no-png"], out=io.StringIO())
