"""The t and placement search prices what the simulator charges (issue 24, item 6).

With the oracle predictor (sim/foresight.py) a layer's placement is searched on the loads it then
routes, so the search's own modelled time of the placement it takes
(``OverlapChoice.modelled_s``) must be exactly what the simulator charges the layer's MoE part:
exchanges and compute, the gather past its window, the reduce past the backward's, wherever
calibration leaves the placement alone. A price that drifted from the charge (another window,
another plan, another reduce) fails here; under the sliding window what remains between the two
is the prediction's error. Also: the oracle predictor's own contract."""
import dataclasses

import pytest
import torch

import ds_fssdp.planner.baselines.fssdp as fssdp_policy
from ds_fssdp.sim.foresight import ForesightPredictor, make_predictor
from ds_fssdp.sim.cluster import PolicyRun, run_cluster
from test_sim_schedule import HW, small_setup, trace


@pytest.fixture
def choices(monkeypatch):
    """Every OverlapChoice the search returns, in call order."""
    out = []
    search = fssdp_policy.FSSDPPolicy.overlap_choice

    def recorded(self, *args, **kwargs):
        out.append(search(self, *args, **kwargs))
        return out[-1]

    monkeypatch.setattr(fssdp_policy.FSSDPPolicy, "overlap_choice", recorded)
    return out


@pytest.mark.parametrize("calibration", [False, True])
@pytest.mark.parametrize("name", ["fssdp", "fssdp-rm"])
def test_the_search_prices_exactly_what_the_simulator_charges(choices, name, calibration):
    # a slow node link: the window hides few experts and the search takes more (the compute pays)
    setup = small_setup(hw=dataclasses.replace(HW, inter_bw=5e9), calibration=calibration, budget=6, budget_rm=10)
    tokens_SLED = trace(steps=10, std=0.2)
    S, L = tokens_SLED.shape[:2]
    decisions, charges = [], []
    run_cluster([PolicyRun(name, setup, predictor="oracle", decisions=decisions, charges=charges)], tokens_SLED,
                bound=False)
    assert len(choices) == S * L  # every layer searched (the oracle predicts from step 0)
    checked = beyond_window = exposed = 0
    for s in range(S):
        for l in range(L):
            choice, charge = choices[s * L + l], charges[s][l]
            _, placed_ED, held_ED = decisions[s][l]
            assert torch.equal(choice.placement_ED.bool(), placed_ED.bool())
            if charge.calibration_s or not torch.equal(placed_ED.bool(), held_ED.bool()):
                continue  # calibration changed the placement after the search
            assert choice.modelled_s == pytest.approx(charge.total_s, rel=1e-9, abs=1e-12), (s, l)
            checked += 1
            exposed += charge.gather_s + charge.reduce_s > 0
            # PolicyRun's default placement ("paper") is the configured family
            beyond_window += choice.overlap_degree > choice.window_t or choice.family != "paper"
    assert checked >= S * L // 2
    if not calibration:
        assert checked == S * L
    assert beyond_window > 0  # the search moved away from the window's t somewhere: not a trivial equality
    assert exposed > 0  # and some transfer was priced past its window


def test_foresight_predicts_the_foreseen_loads_until_observed():
    p = ForesightPredictor([3, 3], window=2)
    seen = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 5.0]], dtype=torch.float64)
    assert p.predict_tokens(0) is None and p.predict(0) is None
    p.foresee(0, torch.tensor([[9, 0], [0, 0], [1, 1]]))
    assert p.predict_tokens(0).tolist() == [[9.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert p.predict(0).tolist() == [9.0, 0.0, 2.0]
    assert p.predict(1) is None  # another layer is not foreseen
    p.foresee(0, seen)
    assert p.observe(0, seen) == 0.0  # its prediction was the load
    assert torch.equal(p.predict_tokens(0), seen)  # forgotten: the window's mean again
    p.observe(0, 2 * seen)
    assert torch.allclose(p.predict_tokens(0), 1.5 * seen) and torch.allclose(p.predict(0), 1.5 * seen.sum(1))
    assert p.predict_all() is None  # layer 1 has no history: re-shards see the window alone


def test_foresight_refuses_bad_shapes_and_kinds():
    p = ForesightPredictor(4)
    with pytest.raises(ValueError, match=r"layer 0: foreseen loads have shape \(3, 2\), expected \[4, ranks\]"):
        p.foresee(0, torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"predictor \('crystal'\) must be one of \('window', 'oracle'\)"):
        make_predictor("crystal", 4, window=5)
    assert type(make_predictor("window", 4, window=5)).__name__ == "LoadPredictor"


def test_the_cli_refuses_the_oracle_at_cluster_scale():
    from ds_fssdp.sim.__main__ import main
    with pytest.raises(SystemExit, match="--predictor oracle: the paper's report only"):
        main(["--trace", "synthetic", "--cluster", "b", "--model", "gpt-s-moe", "--gpus", "16", "--group-size", "8",
              "--predictor", "oracle", "--steps", "8", "--no-png", "--json"])
