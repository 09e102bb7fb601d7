"""Gradients in the gaps (``fssdp.grads_in_gaps``): 4 gloo ranks as 2 FSSDP groups of 2 (EDP groups
of 2), gradient accumulation 2, re-materialization on. Each layer's EDP reduce starts during the
backward of the layers below it, sliced; the reduced expert gradients after every step, the losses
and the final weights equal the reduce-at-the-step path bitwise (two ranks sum each element in the
same order) and the single-process reference (fp32 SGD, tight). Under ZeRO 0 (all-reduce) and
ZeRO 1/2 (reduce-scatter into the partitioned slices), within one node and across two logical
nodes (the replica reduce's second phase lands inside the backward); forced small slices (many
collectives per layer) and slices planned from the cost model. The same runs check the replicas
on the idle link: layer 1's gather starts before layer 0's token exchange, recorded in the stats."""
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
}
RUNS = {}
for _name, (_gaps, _slice) in PAIRS.items():
    RUNS[_name + "-gaps"] = (_gaps, _slice)
    _sync = dict(_gaps, fssdp=dict(_gaps["fssdp"], grads_in_gaps=False))
    RUNS[_name + "-sync"] = (_sync, None)


def _worker(rank, world, runs, steps):
    from ds_fssdp.runtime.stage import FSSDPStage
    out = {}
    original_before, original_attach = FSSDPStage.before_step, FSSDPStage.attach
    original_after_backward = FSSDPStage.after_backward
    for name, (cfg, slice_bytes) in runs.items():
        grads, started, folded, slices, early, flight = [], [], [], [], [], []

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

        def attach(self, engine, _orig=original_attach):
            _orig(self, engine)
            if slice_bytes is not None:
                self.gap_slice_bytes = [slice_bytes] * len(self.shards)  # forced: many slices per layer

        FSSDPStage.before_step, FSSDPStage.attach, FSSDPStage.after_backward = before_step, attach, after_backward
        try:
            res = train_worker(rank, world, {name: cfg}, steps)[name]
        finally:
            FSSDPStage.before_step, FSSDPStage.attach = original_before, original_attach
            FSSDPStage.after_backward = original_after_backward
        out[name] = dict(res, grads=grads, started=started, folded=folded, slices=slices, early=early,
                         flight=flight)
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
