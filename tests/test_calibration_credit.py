"""Calibration's credit in the search by time (planner/layer.py, planner/baselines/fssdp.py).

The search prices candidates on the predicted loads, on which calibration has nothing left to fix,
so it could not see what a placement that leaves calibration room is worth once the actual loads
arrive. The layer planner hands it calibration's realized net saving on this layer (the mean over
the last load-window observed iterations whose placement left it room; an evaluation forward plans
but is not observed), and the search takes it off every candidate that leaves room (not the one
that holds every expert on every rank). The choice's ``modelled_s`` stays the placement's price."""
import dataclasses

import pytest
import torch

from ds_fssdp.planner.baselines import Clock, PolicyConfig, make_policy
from ds_fssdp.planner.calibrate import Calibration, leaves_room
from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.layer import LayerPlanner
from ds_fssdp.planner.overlap import layer_seconds
from ds_fssdp.planner.predict import LoadPredictor
from ds_fssdp.planner.shard import homogeneous_owner
from ds_fssdp.topology import Topology

E, D = 16, 8
TOPO = Topology(num_ranks=D, ranks_per_node=4)
SHAPE = ExpertShape(hidden=256, ffn=512, matrices=2, param_bytes=2)


def test_leaves_room_unless_every_rank_holds_every_expert():
    full_ED = torch.ones(E, D, dtype=torch.bool)
    assert not leaves_room(full_ED, 4)
    one_missing = full_ED.clone()
    one_missing[3, 5] = False
    assert leaves_room(one_missing, 4) and not leaves_room(one_missing, 0)


class _Recorder:
    """A policy that records the clock pre-gating gets and returns a given calibration."""

    def __init__(self, budget=4):
        self.config = dataclasses.make_dataclass("C", [("budget", int)])(budget)
        self.clocks, self.calibration = [], None

    def pre_gating_t(self, layer, owner_E, predicted, *, clock=None):
        self.clocks.append(clock)
        return torch.ones(E, D, dtype=torch.bool), E

    def post_gating(self, layer, owner_E, placement_ED, *, tokens_ED, clock=None):
        return dataclasses.make_dataclass("Plan", [("calibration", object)])(self.calibration)


def _calibration(accepted, saved, extra):
    return Calibration(torch.zeros(E, D, dtype=torch.bool), accepted, 1, saved, extra, 2)


def test_the_credit_is_the_mean_realized_saving_of_observed_iterations_with_room():
    policy = _Recorder()
    planner = LayerPlanner(policy, LoadPredictor([E], window=3), 0)
    owner_E, tokens_ED = homogeneous_owner(E, D), torch.ones(E, D, dtype=torch.long)
    room_ED = torch.eye(E, D, dtype=torch.bool)
    full_ED = torch.ones(E, D, dtype=torch.bool)
    clock = Clock(overlap_degree=2, window_s=1e-3)

    def iteration(placement_ED, cal, observe=True):
        policy.calibration = cal
        planner.pre_gating_t(owner_E, clock)
        planner.post_gating(owner_E, placement_ED, tokens_ED, clock, overlap_t=2)
        if observe:
            planner.observe(tokens_ED)
        return policy.clocks[-1].calibration_credit_s

    assert iteration(room_ED, _calibration(True, 3e-3, 1e-3)) == 0.0  # nothing realized yet; then net 2 ms
    assert iteration(room_ED, _calibration(False, 5e-4, 1e-3)) == pytest.approx(2e-3)  # then rejected: 0
    assert iteration(full_ED, _calibration(True, 9e-3, 0.0)) == pytest.approx(1e-3)  # then no room: not kept
    assert iteration(room_ED, _calibration(True, 9e-3, 0.0), observe=False) == pytest.approx(1e-3)  # not observed
    assert iteration(room_ED, None) == pytest.approx(1e-3)  # then no calibration: nothing
    assert iteration(room_ED, _calibration(True, 4e-3, 0.0)) == pytest.approx(1e-3)  # then 4 ms
    assert iteration(room_ED, None) == pytest.approx(2e-3)  # (2 + 0 + 4) / 3: the window's three
    planner.pre_gating_t(owner_E, None)
    assert policy.clocks[-1] is None  # no clock, no credit


def _policy(*, calibration: bool):
    cost = CostModel(Hardware(flops=1e11, intra_bw=1e12, inter_bw=2.5e11), SHAPE, TOPO, relay=True)
    config = PolicyConfig(num_experts=E, num_layers=1, topology=TOPO, budget=E, overlap_degree=1, cost=cost,
                          overlap_by_time=True, calibration=calibration)
    return make_policy("fssdp", config), cost


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    share_E = torch.rand(E, generator=g) ** 2
    share_E /= share_E.sum()
    return (share_E[:, None] * 8192 * (0.5 + torch.rand(E, D, generator=g))).round()


def _price(policy, cost, owner_E, placement_ED, tokens_ED, clock):
    return layer_seconds(cost, owner_E, placement_ED, tokens_ED.long(), plan_of=policy.compact_plan,
                         window_s=clock.window_s, rematerialize=policy.rematerialize)


def test_the_credit_is_taken_off_candidates_with_room_and_can_keep_a_smaller_t():
    """Slow compute, fast links, a full budget: the search replicates every expert everywhere. A
    credit worth more than what that saves over the smaller t's keeps a placement with room
    instead, and no credit is ever taken off the full one; without calibration the clock's credit
    is ignored."""
    owner_E, tokens_ED = homogeneous_owner(E, D), _tokens()
    policy, cost = _policy(calibration=True)
    clock = Clock(overlap_degree=1, window_s=cost.overlap_window(1))
    plain = policy.overlap_choice(owner_E, tokens_ED, clock)
    assert bool(plain.placement_ED.all()) and plain.credit_s == 0.0  # every expert on every rank
    window_ED = policy._place(owner_E, tokens_ED, 1)
    gap = _price(policy, cost, owner_E, window_ED, tokens_ED, clock) - plain.modelled_s
    assert gap > 0
    credited = policy.overlap_choice(owner_E, tokens_ED, dataclasses.replace(clock, calibration_credit_s=2.0 * gap))
    assert not bool(credited.placement_ED.all()) and credited.credit_s == pytest.approx(2.0 * gap)
    assert credited.modelled_s == pytest.approx(_price(policy, cost, owner_E, credited.placement_ED, tokens_ED, clock))
    assert credited.modelled_s - credited.credit_s < plain.modelled_s  # what it was chosen by
    uncalibrated, _ = _policy(calibration=False)
    ignored = uncalibrated.overlap_choice(owner_E, tokens_ED, dataclasses.replace(clock, calibration_credit_s=2.0 * gap))
    assert torch.equal(ignored.placement_ED, plain.placement_ED) and ignored.credit_s == 0.0
