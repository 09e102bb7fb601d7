"""The HF families whose blocks run their shared experts after their experts (DeepSeek-V2/V3,
GLM-4-MoE) compute them beside the chunked exchange (``moe/side.py``) on 2 gloo ranks at fixed
pipeline degrees, and train exactly like single-process HF training (3 SGD steps: losses and
every final weight), with re-materialization, non-reentrant checkpointing and ZeRO-2 too: the
shared module computed once per layer and forward (twice under checkpointing), inside the exchange
(``side_overlapped``), never again by the block; under ZeRO-3 by the block, as written.
"""
import pytest
import torch

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks (about 25 s)

pytest.importorskip("transformers")

RUNS = [
    ("deepseek_v3", dict(pipeline_degree={"forward": 2, "backward": 3})),
    ("deepseek_v3", dict(pipeline_degree={"forward": 2, "backward": 3}, rematerialize=True)),
    ("deepseek_v3", dict(pipeline_degree={"forward": 3, "backward": 2}, ckpt=False)),
    ("deepseek_v2", dict(pipeline_degree={"forward": 3, "backward": 2}, one_copy_per_destination=False)),
    ("glm4_moe", dict(pipeline_degree=2)),
    # ZeRO-2's gradient hooks fire inside the layer's backward; under ZeRO-3 the block computes them
    ("deepseek_v3", dict(pipeline_degree={"forward": 2, "backward": 3}, zero=2)),
    ("deepseek_v3", dict(pipeline_degree={"forward": 2, "backward": 3}, zero=3)),
]


def _worker(rank, world, runs):
    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    from hf_tiny import BIASED, tiny_model
    from test_hf_families_training import RATE, ds_config, train_steps
    out = []
    for mt, opts in runs:
        opts = dict(opts)
        ckpt = opts.pop("ckpt", None)
        zero = opts.pop("zero", 1)
        model = fssdp_hf.convert(tiny_model(mt), route_initialize=False)
        calls = [0]
        sides = [m.side for _, m in fssdp_hf.converted_experts(model)]
        for side in sides:
            own = side._forward

            def counted(*args, own=own, **kwargs):
                calls[0] += 1
                return own(*args, **kwargs)
            side._forward = counted
        if ckpt is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
        model.train()
        rate = RATE if mt in BIASED else 0.0
        cfg = ds_config(router_bias_update_rate=rate, **opts)
        cfg["zero_optimization"] = {"stage": zero}
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        losses, _, replicas = train_steps(engine, model, rank)
        overlapped = [m.last_stats["side_overlapped"] for _, m in fssdp_hf.converted_experts(model)]
        out.append(dict(losses=losses, state=fssdp_hf.hf_state_dict(model), calls=calls[0], layers=len(sides),
                        overlapped=overlapped, replicas=replicas))
    return out


def test_shared_experts_beside_the_exchange_train_exactly():
    from hf_tiny import BIASED
    from test_hf_families_training import RATE, STEPS, TOL, reference

    results = spawn(2, _worker, RUNS)
    refs = {}
    for i, (mt, opts) in enumerate(RUNS):
        ckpt = opts.get("ckpt")
        key = (mt, ckpt)
        if key not in refs:
            refs[key] = reference(mt, rate=RATE if mt in BIASED else 0.0, ckpt=ckpt)
        ref_losses, ref_state, _ = refs[key]
        for rank, res in enumerate(results):
            run = res[i]
            beside = opts.get("zero", 1) < 3
            assert run["overlapped"] == [int(beside)] * run["layers"], (mt, opts)
            # once per layer and forward (a recompute forward again): computed inside the exchange
            # and handed to the block, never twice
            assert run["calls"] == STEPS * run["layers"] * (2 if ckpt is not None else 1), (mt, opts)
            assert run["replicas"] > 0
            want = [ref_losses[(s, rank)] for s in range(STEPS)]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL)
            for key_, value in ref_state.items():
                torch.testing.assert_close(run["state"][key_], value, rtol=1e-4, atol=1e-6, msg=f"{mt} {opts} {key_}")
