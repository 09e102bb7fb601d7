"""Gradients in the gaps (``fssdp.grads_in_gaps``): 4 gloo ranks as 2 FSSDP groups of 2 (EDP groups
of 2), gradient accumulation 2, re-materialization on. Each layer's EDP reduce starts during the
backward of the layers below it, sliced; the reduced expert gradients after every step, the losses
and the final weights equal the reduce-at-the-step path bitwise (two ranks sum each element in the
same order) and the single-process reference (fp32 SGD, tight). Under ZeRO 0 (all-reduce) and
ZeRO 1/2 (reduce-scatter into the partitioned slices), within one node and across two logical
nodes (the replica reduce's second phase lands inside the backward); forced small slices (many
collectives per layer) and slices planned from the cost model. The same runs check the replicas
on the idle link: layer 1's gather starts before layer 0's token exchange, recorded in the stats.

Under ZeRO 1/2 the same setting leaves the step's EDP all-gather of the stepped slices in flight
(parameters in the gaps): each layer lands at its first use in the next forward; a checkpoint-like
read right after a step and a re-shard right after a step (``reshard_interval`` 2: after the
second) see the updated weights, bitwise the synchronous run's."""
import pytest
import torch

from distributed import spawn
from training import assert_matches_reference, ds_config, train_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks; > 30 s

WORLD, STEPS = 4, 3
HW = {"flops": 1e9, "intra_bw": 1e9, "inter_bw": 1e8}


def _cfg(zero, gaps, **fssdp):
    section = dict({"group_size": 2, "rematerialize": True, "metrics_csv": None, "grads_in_gaps": gaps}, **fssdp)
    return ds_config(world=WORLD, zero=zero, gas=2, fssdp=section)


PAIRS = {  # name: (gaps config, forced slice bytes or None)
    "z0": (_cfg(0, True, ranks_per_node=2), 256),
    "z1-rpn1": (_cfg(1, True, ranks_per_node=1), 200),
    "z2-costs": (_cfg(2, True, ranks_per_node=2, hardware=HW), None),
    "z1-reshard": (_cfg(1, True, ranks_per_node=2, reshard_interval=2), None),  # re-shards after step 1
}
DEFERRED = ("z1-rpn1-gaps", "z2-costs-gaps", "z1-reshard-gaps")  # ZeRO >= 1 with gaps: all-gathers deferred
RUNS = {}
for _name, (_gaps, _slice) in PAIRS.items():
    RUNS[_name + "-gaps"] = (_gaps, _slice)
    _sync = dict(_gaps, fssdp=dict(_gaps["fssdp"], grads_in_gaps=False))
    RUNS[_name + "-sync"] = (_sync, None)


def _watch_landings(events: list, layer_of: dict) -> dict:
    """Wrap where the rows are gathered, landed and computed with, appending ("gather" | "land" |
    "forward", layer) to ``events`` ("land" only where a landing was pending). Returns the originals."""
    from ds_fssdp.moe.replicas import ReplicaManager
    from ds_fssdp.moe.sharded import ShardedExperts
    orig = {"gather": ReplicaManager.start_gather, "land": ReplicaManager.land, "forward": ShardedExperts.forward}

    def start_gather(self, layout):
        events.append(("gather", layer_of[id(self)]))
        return orig["gather"](self, layout)

    def land(self):
        if self.landing:
            events.append(("land", layer_of[id(self)]))
        return orig["land"](self)

    def forward(self, *args, **kwargs):
        events.append(("forward", self.layer_index))
        return orig["forward"](self, *args, **kwargs)

    ReplicaManager.start_gather, ReplicaManager.land, ShardedExperts.forward = start_gather, land, forward
    return orig


def _unwatch_landings(orig: dict) -> None:
    from ds_fssdp.moe.replicas import ReplicaManager
    from ds_fssdp.moe.sharded import ShardedExperts
    ReplicaManager.start_gather, ReplicaManager.land, ShardedExperts.forward = (orig["gather"], orig["land"],
                                                                                 orig["forward"])


def _worker(rank, world, runs, steps):
    from ds_fssdp.runtime.stage import FSSDPStage
    out = {}
    original_before, original_attach = FSSDPStage.before_step, FSSDPStage.attach
    original_after_backward, original_after_step = FSSDPStage.after_backward, FSSDPStage.after_step
    for name, (cfg, slice_bytes) in runs.items():
        grads, started, folded, slices, early, flight, published, waits = [], [], [], [], [], [], [], []
        events, layer_of = [], {}

        def after_backward(self, loss=None, _orig=original_after_backward):
            """In flight after the backward; a re-shard then is refused by name; waiting lands it
            (what a checkpoint save or load does first), and the step still uses the result."""
            _orig(self, loss)
            record = {"in_flight": self.expert_state.in_flight}
            if record["in_flight"] and len(flight) == 1:  # the first boundary
                try:
                    self.expert_state.migrate(0, self.shards[0].owner_E, self.param_group)
                except RuntimeError as err:
                    record["refused"] = str(err)
                self.wait_in_flight()
                record["after_wait"] = self.expert_state.in_flight
            flight.append(record)

        def before_step(self, engine, _orig=original_before):
            slices.append(list(self.gap_slice_bytes))
            _orig(self, engine)  # reduces: every expert gradient of the step is final here
            grads.append([p.grad.detach().clone() for p in self.masters()])
            started.append(list(self._gaps_started))
            folded.append([bool(s.stats.get("folded_in_backward")) for s in self.shards])
            early.append([{k: s.stats.get(k) for k in ("gather_started_early", "next_gather_started_early",
                                                       "gather_early_s", "window_s")} for s in self.shards])
            waits.append([s.stats.get("edp_gather_wait_s") for s in self.shards])

        def after_step(self, engine, _orig=original_after_step):
            """What the step left pending; after the last step, what a checkpoint then reads."""
            before = [s.rows.detach().clone() for s in self.shards]
            owners = [s.owner_E.clone() for s in self.shards]
            events.append(("step", -1))
            _orig(self, engine)
            events.append(("stepped", -1))
            record = {"deferred": self.last_step["edp_gather_in_gaps"],
                      "pending": [s.replicas.landing for s in self.shards],
                      "stale": [torch.equal(s.rows, b) for s, b in zip(self.shards, before)],
                      "moved": any(not torch.equal(s.owner_E, o) for s, o in zip(self.shards, owners))}
            if len(published) == steps - 1:  # the last step: as a checkpoint save reads it
                self.wait_in_flight()
                record["pending_after_wait"] = [s.replicas.landing for s in self.shards]
                full = [self.expert_state.full_state(i)[0].clone() for i in range(len(self.shards))]
                record.update(full=full, rows_are_full=[torch.equal(s.rows, f) for s, f in zip(self.shards, full)],
                              changed=[not torch.equal(s.rows, b) for s, b in zip(self.shards, before)])
            published.append(record)

        def attach(self, engine, _orig=original_attach):
            _orig(self, engine)
            layer_of.update({id(s.replicas): i for i, s in enumerate(self.shards)})
            if slice_bytes is not None:
                self.gap_slice_bytes = [slice_bytes] * len(self.shards)  # forced: many slices per layer

        FSSDPStage.before_step, FSSDPStage.attach, FSSDPStage.after_backward = before_step, attach, after_backward
        FSSDPStage.after_step = after_step
        watched = _watch_landings(events, layer_of)
        try:
            res = train_worker(rank, world, {name: cfg}, steps)[name]
        finally:
            FSSDPStage.before_step, FSSDPStage.attach = original_before, original_attach
            FSSDPStage.after_backward, FSSDPStage.after_step = original_after_backward, original_after_step
            _unwatch_landings(watched)
        out[name] = dict(res, grads=grads, started=started, folded=folded, slices=slices, early=early,
                         flight=flight, published=published, waits=waits, events=events)
    return out


@pytest.fixture(scope="module")
def trained():
    return spawn(WORLD, _worker, RUNS, STEPS)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_gaps_equal_the_reduce_at_the_step_bitwise(trained, pair):
    for rank in range(WORLD):
        gaps, sync = trained[rank][pair + "-gaps"], trained[rank][pair + "-sync"]
        assert gaps["losses"] == sync["losses"], f"{pair} rank {rank}: losses differ"
        assert len(gaps["grads"]) == STEPS
        for step, (g, s) in enumerate(zip(gaps["grads"], sync["grads"])):
            for layer, (a, b) in enumerate(zip(g, s)):
                assert torch.equal(a, b), f"{pair} rank {rank} step {step} layer {layer}: reduced gradients differ"
        for layer, (a, b) in enumerate(zip(gaps["experts"], sync["experts"])):
            for n in a:
                assert torch.equal(a[n], b[n]), f"{pair} rank {rank} layer {layer} {n}: weights differ"
        for n in gaps["dense"]:
            assert torch.equal(gaps["dense"][n], sync["dense"][n]), f"{pair} rank {rank} {n}: dense differs"


@pytest.mark.parametrize("name", list(RUNS))
def test_gaps_and_sync_equal_the_single_process_reference(trained, name):
    cfg = RUNS[name][0]
    assert_matches_reference([r[name] for r in trained], cfg, world=WORLD, steps=STEPS,
                             tol=dict(rtol=2e-5, atol=2e-6), name=name)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_the_upper_layers_reduce_during_the_backward(trained, pair):
    """With two layers, layer 1's reduce starts in layer 0's backward (after its replica reduce was
    folded in there) on every boundary step; without gaps nothing does."""
    for rank in range(WORLD):
        gaps, sync = trained[rank][pair + "-gaps"], trained[rank][pair + "-sync"]
        assert gaps["started"] == [[1]] * STEPS, gaps["started"]
        assert all(f == [False, True] for f in gaps["folded"]), gaps["folded"]
        assert sync["started"] == [[]] * STEPS
        assert not any(any(f) for f in sync["folded"])


@pytest.mark.parametrize("pair", list(PAIRS))
def test_work_in_flight_only_on_the_boundary_and_waited_before_moving_state(trained, pair):
    """After a boundary backward layer 1's reduce is in flight (none after the others, none without
    gaps); re-sharding then is refused by name, and wait_in_flight (checkpoint save and load call
    it first) lands it; the step's results stay bitwise the reduce at the step's (the test above)."""
    for rank in range(WORLD):
        gaps, sync = trained[rank][pair + "-gaps"]["flight"], trained[rank][pair + "-sync"]["flight"]
        assert [f["in_flight"] for f in gaps] == [0, 1] * STEPS
        assert [f["in_flight"] for f in sync] == [0, 0] * STEPS
        assert "in flight" in gaps[1]["refused"] and gaps[1]["after_wait"] == 0
        assert all("refused" not in f for f in gaps[2:])


def test_slices_are_forced_or_planned_and_agreed(trained):
    """Forced slices stay; planned ones come from the cost model after the first step (default
    before), the same on every rank of the world here (one EDP-wide minimum)."""
    assert trained[0]["z0-gaps"]["slices"][0] == [256, 256]
    plans = [trained[r]["z2-costs-gaps"]["slices"] for r in range(WORLD)]
    assert plans[0][0] == [None, None]
    for step in range(1, STEPS):
        assert all(isinstance(v, int) and v > 0 for v in plans[0][step]), plans[0]
        for r in range(1, WORLD):
            if r % 2 == 0:  # rank 0's EDP group is {0, 2}
                assert plans[r][step] == plans[0][step]


def test_next_layers_gather_starts_before_the_exchange(trained):
    """Replicas on the idle link: layer 0 starts layer 1's gather after its dispatch plan, before
    its token exchange and expert compute; layer 1's window (schedule.overlap_window) covers that
    compute and its attention; layer 0's gather starts with the model's forward, as before."""
    for rank in range(WORLD):
        for name in RUNS:
            for layer0, layer1 in trained[rank][name]["early"]:
                assert layer0["next_gather_started_early"] and not layer0["gather_started_early"]
                assert layer0["gather_early_s"] == 0.0
                assert layer1["gather_started_early"] and not layer1["next_gather_started_early"]
                assert 0.0 < layer1["gather_early_s"] < layer1["window_s"]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_step_leaves_the_edp_all_gathers_in_flight(trained, name):
    """Under ZeRO >= 1 with gaps every layer's EDP all-gather is started at the step and left
    pending: the rows still hold the pre-step weights when the step returns, unless a re-shard
    right after it landed them (it must, before moving anything). Under ZeRO 0 or without gaps
    nothing is pending and the rows hold the new weights."""
    for rank in range(WORLD):
        records = trained[rank][name]["published"]
        assert len(records) == STEPS
        for step, rec in enumerate(records):
            where = f"{name} rank {rank} step {step}"
            if name not in DEFERRED:
                assert rec["deferred"] == [] and rec["pending"] == [False, False], where
                assert rec["stale"] == [False, False], where
            elif rec["moved"]:
                assert rec["deferred"] == [0, 1] and rec["pending"] == [False, False], where
            else:
                assert rec["deferred"] == [0, 1] and rec["pending"] == [True, True], where
                assert rec["stale"] == [True, True], where
        if name == "z1-reshard-gaps":  # experts moved right after a deferring step, and not after others
            moved = [rec["moved"] for rec in records]
            assert any(moved) and not all(moved), moved


def _between_steps(events: list, step: int) -> list:
    """The events from step ``step``'s return to the next step's start (its micro-steps)."""
    ends = [k for k, e in enumerate(events) if e[0] == "stepped"]
    starts = [k for k, e in enumerate(events) if e[0] == "step"]
    return events[ends[step] + 1:starts[step + 1]]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_layer_lands_at_its_first_use_in_the_next_forward(trained, name):
    """Layer 0 lands in the next forward's first gather (the model's forward pre-hook), before it
    computes; layer 1 lands later, in its gather started during layer 0's forward. Nothing lands
    without a deferred all-gather."""
    for rank in range(WORLD):
        run = trained[rank][name]
        events = run["events"]
        if name not in DEFERRED:
            assert not any(e[0] == "land" for e in events), events
            continue
        checked = 0
        for step in range(STEPS - 1):  # after the last step, the checkpoint-like read lands them
            if run["published"][step]["moved"]:
                continue
            after = _between_steps(events, step)
            assert [e for e in after if e[0] == "land"] == [("land", 0), ("land", 1)], after
            assert after[:3] == [("gather", 0), ("land", 0), ("forward", 0)], after
            k = after.index(("land", 1))
            assert after[k - 1] == ("gather", 1) and after.index(("forward", 0)) < k < after.index(("forward", 1))
            checked += 1
        assert checked >= 1, name


def test_landing_waits_are_recorded_per_layer(trained):
    """Each layer's stats carry the seconds its last landing took (``edp_gather_wait_s``, a
    metrics column): none before the first step, positive after every deferring step, 0 when the
    all-gather ran at the step."""
    for rank in range(WORLD):
        for name in RUNS:
            waits = trained[rank][name]["waits"]
            assert len(waits) == STEPS and waits[0] == [0.0, 0.0], (name, waits)
            if name in DEFERRED:
                assert all(w > 0.0 for step in waits[1:] for w in step), (name, waits)
            else:
                assert all(w == 0.0 for step in waits for w in step), (name, waits)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_read_right_after_the_step_sees_the_update(trained, pair):
    """After the last step, ``wait_in_flight`` (what a checkpoint save does first) lands every
    layer: the rows changed and equal the full master ``full_state`` gathers, which is bitwise the
    synchronous run's."""
    for rank in range(WORLD):
        gaps = trained[rank][pair + "-gaps"]["published"][-1]
        sync = trained[rank][pair + "-sync"]["published"][-1]
        assert gaps["pending_after_wait"] == [False, False]
        assert gaps["rows_are_full"] == [True, True] and gaps["changed"] == [True, True], gaps
        for layer, (a, b) in enumerate(zip(gaps["full"], sync["full"])):
            assert torch.equal(a, b), f"{pair} rank {rank} layer {layer}: full master differs from the sync run's"
