"""The simulators' pipeline stages (sim/stages.py): DeepSpeed's 1F1B order and its closed form, the
stage cut, the budget for the micro-batches in flight, and one small run of the CLI."""
import io
import json

import numpy as np
import pytest

from ds_fssdp.sim.stages import one_f_one_b, stage_layers, train_order


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 3), (4, 8), (3, 1)])
def test_the_order_is_deepspeeds_train_schedule(stages, micro):
    from deepspeed.runtime.pipe import schedule
    for s in range(stages):
        kinds = [type(c).__name__[0] for cmds in schedule.TrainSchedule(micro_batches=micro, stages=stages, stage_id=s)
                 for c in cmds if type(c).__name__ in ("ForwardPass", "BackwardPass")]
        assert [k for k, _ in train_order(stages, s, micro)] == kinds
        order = train_order(stages, s, micro)
        assert [i for k, i in order if k == "F"] == list(range(micro)) == [i for k, i in order if k == "B"]


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 2)])
def test_even_stages_take_the_textbook_1f1b_time(stages, micro):
    """Equal stages, forward f and backward b: (G + S - 1)(f + b), a bubble of (S - 1) / (G + S - 1);
    transfers of p add at least the fill's and the drain's 2 (S - 1) p."""
    f, b, p = 1.0, 2.0, 0.25
    F, B = np.full((stages, micro), f), np.full((stages, micro), b)
    makespan, last, busy = one_f_one_b(F, B, 0.0)
    assert makespan == pytest.approx((micro + stages - 1) * (f + b))
    assert 1 - busy.max() / makespan == pytest.approx((stages - 1) / (micro + stages - 1))
    assert makespan == last[0] and np.all(np.diff(last) <= 0)  # stage 0 ends last
    assert one_f_one_b(F, B, p)[0] >= makespan + 2 * (stages - 1) * p


def test_a_slow_micro_batch_delays_the_pipeline_by_its_excess():
    F, B = np.ones((2, 4)), np.full((2, 4), 2.0)
    base = one_f_one_b(F, B)[0]
    F[1, 2] += 5.0  # the last stage's third forward
    assert one_f_one_b(F, B)[0] == pytest.approx(base + 5.0)


def test_stage_cut():
    assert stage_layers(58, 4) == [14, 14, 15, 15]
    assert stage_layers(3, 2) == [1, 2]
    with pytest.raises(ValueError, match=r"pipeline stages \(5\) must be between 1 and the 4 MoE layers"):
        stage_layers(4, 5)


def test_cli_runs_every_policy_under_the_stages():
    from ds_fssdp.sim.__main__ import main
    out = io.StringIO()
    main(["--trace", "synthetic", "--cluster", "a", "--model", "gpt-s-moe", "--gpus", "16", "--pipeline-stages", "2",
          "--micro-batches", "4", "--steps", "3", "--json", "--no-png"], out=out)
    got = json.loads(out.getvalue())
    assert got["pipeline_stages"] == 2 and [st["num_layers"] for st in got["stages"]] == [6, 6]
    by = {r["policy"]: r for r in got["results"]}
    assert set(by) == {"ep", "fsmoe", "fssdp", "fssdp-rm"}
    for r in by.values():
        assert r["step_ms"] >= got["lower_bound_ms"]  # a bound
        assert 0.0 < r["bubble"] < 1.0 and r["pipeline_ms"] >= max(r["busy_ms"])
    assert by["fssdp"]["step_ms"] < by["ep"]["step_ms"]
    # the budget counts the micro-batches in flight: 2 on stage 0, 1 on stage 1
    assert by["fssdp"]["budget"][0] < by["fssdp"]["budget"][1]


def test_micro_batches_without_stages_are_refused():
    from ds_fssdp.sim.__main__ import main
    with pytest.raises(SystemExit, match=r"--micro-batches \(4\) needs --pipeline-stages above 1"):
        main(["--trace", "synthetic", "--micro-batches", "4", "--no-png"], out=io.StringIO())
