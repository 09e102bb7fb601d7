"""DeepSpeed AutoTP with FSSDP experts folded over the TP group trains exactly.

AutoTP (``tensor_parallel.autotp_size`` 2, an explicit ``partition_config`` that splits the
attention) shards the dense part; every TP rank holds the same batch, each FSSDP layer dispatches
only its TP rank's slice of the tokens (33 tokens: uneven slices) and all-gathers the outputs;
the FSSDP groups span the TP lanes. The reference is one process: each step the data-parallel
batches' HF loss (router aux loss included) averaged, one global-norm clip (engaged), SGD +
momentum. Losses and every final weight (the attention's gathered from its TP shards) are
compared on every rank. One spawn per world size: p = 2 on 2 ranks (ZeRO 1, and ZeRO 3 with every
dense parameter partitioned) and p = 2 x dp 2 on 4 ranks (ZeRO 1), qwen3_moe (q/k norms over
local heads: gradients all-reduced over TP by AutoTP's ``grad_allreduce``) and mixtral.
"""
import pytest
import torch

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

from hf_tiny import batch, tiny_model  # noqa: E402
from parallel_reference import sgd_reference  # noqa: E402

TP, ROWS, SEQ, STEPS = 2, 3, 11, 3
LR, MOMENTUM, CLIP = 0.2, 0.9, 0.5
TOL = dict(rtol=2e-5, atol=2e-6)
RUNS = {2: [("qwen3_moe", 1), ("mixtral", 1), ("qwen3_moe", 3)], 4: [("qwen3_moe", 1), ("mixtral", 1)]}
PARTITION = {"use_default_specs": False, "layer_specs": [
    {"patterns": [".*\\.[qkv]_proj\\.weight$"], "partition_type": "column"},
    {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"},
    {"patterns": [".*\\.[qk]_norm\\.weight$"], "partition_type": "skip", "grad_allreduce": True},
]}


def model_of(mt):
    return tiny_model(mt, num_key_value_heads=2)  # AutoTP needs p <= KV heads


def ds_config(world, zero=1):
    # No train_batch_size: DeepSpeed counts the TP ranks in it at initialize but not in ZeRO 3's
    # zero.Init, which then refuses any value (DeepSpeed 0.19.8); micro batch x accumulation is enough.
    return {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
            "tensor_parallel": {"autotp_size": TP, "partition_config": PARTITION},
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "fssdp": {"materialization_budget": 2, "overlap_degree": 4, "load_window": 1}}


def _data(step, dp_rank):
    return batch(100 * step + dp_rank, rows=ROWS, seq=SEQ)


def _full_weights(model, tp_group):
    """Every dense weight whole (AutoTP's shards all-gathered), keyed as in the HF state dict."""
    import torch.distributed as tdist
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, (LinearAllreduce, LinearLayer)):
            continue
        parts = [torch.empty_like(mod.weight) for _ in range(TP)]
        tdist.all_gather(parts, mod.weight.detach().contiguous(), group=tp_group)
        out[f"{name}.weight"] = torch.cat(parts, dim=1 if isinstance(mod, LinearAllreduce) else 0)
    return out


def _worker(rank, world, runs):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import groups
    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    out = {}
    for mt, zero in runs:
        model = fssdp_hf.convert(model_of(mt), route_initialize=False)
        model.train()
        engine, *_ = ds_fssdp.initialize(model=model, config=ds_config(world, zero))
        losses, replicas = [], 0
        for step in range(STEPS):
            loss = engine(**_data(step, rank // TP)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            replicas += sum(m.last_stats["replicas"] for _, m in fssdp_hf.converted_experts(model))
        tp_group = groups.get_tensor_model_parallel_group()
        partitioned = any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
        with GatheredParameters(list(model.parameters())):  # ZeRO 3: whole (TP-sharded) parameters
            state = {k: v.clone() for k, v in fssdp_hf.hf_state_dict(model).items()}
            state.update(_full_weights(model, tp_group))
        folds = [m.fold for _, m in fssdp_hf.converted_experts(model)]
        out[(mt, zero)] = dict(losses=losses, state=state, replicas=replicas, grad_scale=engine.fssdp.grad_scale,
                               partitioned=partitioned,
                               folded=all(f is not None and f.size == TP for f in folds),
                               tokens=[m.last_stats["tokens_per_rank"] for _, m in fssdp_hf.converted_experts(model)])
        dist.barrier()
    return out


def reference(mt, world):
    return sgd_reference(model_of(mt), lambda model, step, g: model(**_data(step, g)).loss, steps=STEPS,
                         dp=world // TP, lr=LR, momentum=MOMENTUM, clip=CLIP)


@pytest.fixture(scope="module", params=(2, 4))
def trained(request):
    world = request.param
    return world, spawn(world, _worker, RUNS[world])


def test_autotp_folding_trains_like_single_process(trained):
    world, results = trained
    for mt, zero in RUNS[world]:
        ref_losses, ref_state = reference(mt, world)
        for rank, res in enumerate(results):
            run = res[(mt, zero)]
            assert run["folded"] and run["grad_scale"] == TP / world
            assert run["partitioned"] == (zero == 3)
            assert run["replicas"] > 0
            # Each token computed once in the world: the rows over all ranks are the world's
            # data-parallel batches' assignments (k = 2), not p times them.
            for tokens in run["tokens"]:
                assert sum(tokens) == 2 * ROWS * SEQ * (world // TP)
            want = [ref_losses[(s, rank // TP)] for s in range(STEPS)]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL,
                                       msg=f"{mt} ZeRO {zero} rank {rank}")
            for key, value in ref_state.items():
                assert key in run["state"], key
                torch.testing.assert_close(run["state"][key], value, rtol=1e-4, atol=1e-6,
                                           msg=f"{mt} ZeRO {zero} {rank} {key}")


@pytest.mark.parametrize("config,message", [
    ({"tensor_parallel": {"autotp_size": -1}}, r"tensor_parallel.autotp_size \(-1\) must be"),
    ({"tensor_parallel": {"autotp_size": "2"}}, r"tensor_parallel.autotp_size \('2'\) must be"),
])
def test_tp_refusals_name_the_key_before_any_collective(config, message):
    import ds_fssdp
    from ds_fssdp import FSSDPConfigError, FSSDPMoE
    model = torch.nn.Sequential(FSSDPMoE(hidden_size=4, ffn_hidden_size=8, num_experts=4))
    with pytest.raises(FSSDPConfigError, match=message):
        ds_fssdp.initialize(model=model, config=dict({"train_batch_size": 2, "fssdp": {}}, **config))
    assert not torch.distributed.is_initialized()
