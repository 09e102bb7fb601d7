"""Ulysses sequence parallelism (DeepSpeed's ALST) with FSSDP experts trains exactly.

``UlyssesSPAttentionHF.register_with_transformers`` + ``UlyssesSPDataLoaderAdapter`` shard each
sequence over the SP group; the loss is DeepSpeed's ALST recipe (each rank's summed token loss,
gathered over the SP group with a differentiable all-gather, over the group's token count). The
MoE layers see a different slice of every sequence on every rank. The reference is one process
on the full sequences with DeepSpeed's SP gradient scale: every SP rank backpropagates the same
gathered loss, ZeRO 1 divides the summed gradients by W / s (s times the data-parallel mean of
the full sequences' gradients), ZeRO 3's reduce-scatter by W (1 times that mean); one
global-norm clip (engaged), SGD + momentum. Losses and every final weight are
compared, on every rank.

One spawn per world size: s = 2 on 2 ranks (two families, ZeRO 1 and 3, HF gradient
checkpointing), s = 2 x dp 2 on 4 ranks (two families, ZeRO 1 and 3). Refusals need no ranks.
"""
import pytest
import torch
import torch.nn.functional as F

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

from hf_tiny import VOCAB, tiny_model  # noqa: E402
from parallel_reference import sgd_reference  # noqa: E402

SP, ROWS, SEQ, STEPS = 2, 2, 12, 3
LR, MOMENTUM, CLIP = 0.2, 0.9, 0.5
TOL = dict(rtol=2e-5, atol=2e-6)
SCALE = {1: SP, 3: 1}  # DeepSpeed's SP gradient scale by ZeRO stage (runtime/sequence_parallel.py)
RUNS = {
    2: [("qwen3_moe", dict(zero=1)), ("mixtral", dict(zero=1)), ("qwen3_moe", dict(zero=3)),
        ("mixtral", dict(zero=3)), ("qwen3_moe", dict(zero=1, ckpt=True)), ("mixtral", dict(zero=3, ckpt=True))],
    4: [("qwen3_moe", dict(zero=1)), ("mixtral", dict(zero=3))],
}


def model_of(mt):
    # No router aux loss: ALST's loss is the token loss (the aux loss of a slice is not the aux loss
    # of the sequence, see the README).
    return tiny_model(mt, output_router_logits=False)


def ds_config(world, zero):
    return {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
            "train_batch_size": ROWS * world // SP, "sequence_parallel_size": SP,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}, "gradient_clipping": CLIP,
            # ZeRO 3 partitions every dense parameter, however small (the default keeps small ones whole).
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "fssdp": {"materialization_budget": 2, "overlap_degree": 4, "load_window": 1}}


def sample(rank, j):
    """The j-th batch of rank ``rank``'s own data loader (full sequences)."""
    gen = torch.Generator().manual_seed(1000 * rank + j)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=gen)
    return dict(input_ids=ids, labels=ids.clone(), position_ids=torch.arange(SEQ).expand(ROWS, SEQ).clone())


def source_rank(step, dp_rank):
    """The adapter serves the SP group's batches in SP-rank order, one per step."""
    return dp_rank * SP + step % SP, step // SP


def alst_loss(logits, shift_labels, sp_group):
    """DeepSpeed's ALST recipe: token loss summed per rank, gathered (differentiably) over the SP
    group. (``torch.distributed.nn.functional.all_gather``'s backward fails on gloo subgroups: its
    scatter takes group ranks for global ones; the functional collective's does not.)"""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                               ignore_index=-100, reduction="sum")
    good = (shift_labels != -100).sum().float()
    sums = wait_tensor(all_gather_tensor_autograd(loss_sum.reshape(1), gather_dim=0, group=sp_group))
    goods = wait_tensor(all_gather_tensor_autograd(good.reshape(1), gather_dim=0, group=sp_group))
    return sums.sum() / goods.sum()


def _worker(rank, world, runs):
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.zero import GatheredParameters
    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    # Registered once per process (DeepSpeed's SP groups are module state); both families share
    # the attention geometry (2 heads of 8, 1 KV head) the adapter is built for.
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model_of(runs[0][0]),
                                                          core_attn_implementation="sdpa",
                                                          sequence_parallel_size=SP, micro_batch_size=ROWS)
    group = mpu.get_sequence_parallel_group()
    out = {}
    for mt, opts in runs:
        model = fssdp_hf.convert(model_of(mt), route_initialize=False)
        if opts.get("ckpt"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        engine, *_ = ds_fssdp.initialize(model=model, config=ds_config(world, opts["zero"]), mpu=mpu)
        loader = torch.utils.data.DataLoader([sample(rank, j) for j in range(STEPS)], batch_size=None)
        batches = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                             sp_world_size=SP, device=engine.device)
        losses, replicas = [], 0
        for step in range(STEPS):
            mb = {k: v.contiguous() for k, v in next(batches).items()}  # CPU slices are views
            logits = engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
            loss = alst_loss(logits, mb["shift_labels"], group)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            replicas += sum(m.last_stats["replicas"] for _, m in fssdp_hf.converted_experts(model))
        partitioned = any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
        with GatheredParameters(list(model.parameters())):  # ZeRO 3: whole dense parameters
            state = {k: v.clone() for k, v in fssdp_hf.hf_state_dict(model).items()}
        out[(mt, tuple(sorted(opts.items())))] = dict(
            losses=losses, state=state, replicas=replicas, partitioned=partitioned,
            grad_scale=engine.fssdp.grad_scale, sp_rank=mpu.get_sequence_parallel_rank())
        dist.barrier()
    return out


def reference(mt, world, *, scale, ckpt=False):
    """One process, full sequences: each step the SP groups' batches, gradient ``scale`` x their mean."""
    model = model_of(mt)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def loss_of(model, step, g):
        b = sample(*source_rank(step, g))
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1))

    return sgd_reference(model, loss_of, steps=STEPS, dp=world // SP, lr=LR, momentum=MOMENTUM, clip=CLIP,
                         scale=scale)


@pytest.fixture(scope="module", params=sorted(RUNS))
def trained(request):
    world = request.param
    return world, spawn(world, _worker, RUNS[world])


def test_ulysses_sp_trains_like_single_process_full_sequences(trained):
    world, results = trained
    for mt, opts in RUNS[world]:
        ref_losses, ref_state = reference(mt, world, scale=SCALE[opts["zero"]], ckpt=opts.get("ckpt", False))
        for rank, res in enumerate(results):
            run = res[(mt, tuple(sorted(opts.items())))]
            assert run["grad_scale"] == SCALE[opts["zero"]] / world
            assert run["partitioned"] == (opts["zero"] == 3)
            assert run["replicas"] > 0  # replicas planned and gathered over the ranks' slices
            want = [ref_losses[(s, rank // SP)] for s in range(STEPS)]
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL,
                                       msg=f"{mt} {opts} rank {rank}")
            assert set(run["state"]) == set(ref_state)
            for key, value in ref_state.items():
                torch.testing.assert_close(run["state"][key], value, rtol=1e-4, atol=1e-6,
                                           msg=f"{mt} {opts} rank {rank} {key}")


# -- refusals, before any collective -------------------------------------------------------------
class _SPMpu:
    """Stands in for DeepSpeed's ``parallel_state_sp`` (which needs a started comm): the attributes
    DeepSpeed and FSSDP recognise an SP mpu by."""

    def __init__(self, size):
        self.size = size

    def initialize_sequence_parallel(self, sequence_parallel_size):
        raise AssertionError("not called")

    def get_sequence_parallel_world_size(self):
        return self.size


class _MegatronMpu:

    def get_model_parallel_world_size(self):
        return 2


@pytest.mark.parametrize("config,mpu,message", [
    ({"sequence_parallel_size": 2}, None, r"sequence_parallel_size \(2\) needs the mpu that UlyssesSPAttentionHF"),
    ({"sequence_parallel_size": 4}, _SPMpu(2), r"sequence_parallel_size \(4\) differs from the mpu's .* \(2\)"),
    ({"sequence_parallel_size": 2, "data_parallel_size": 1}, None, r"sequence_parallel_size \(2\) with a device mesh"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, _SPMpu(2),
     r"sequence_parallel_size \(2\) with tensor_parallel.autotp_size \(2\)"),
    ({"sequence_parallel_size": 2, "zero_optimization": {"stage": 3, "reduce_scatter": False}}, _SPMpu(2),
     r"zero_optimization.reduce_scatter \(false\)"),
    ({"sequence_parallel_size": "2"}, _SPMpu(2), r"sequence_parallel_size \('2'\) must be an integer"),
    ({}, _MegatronMpu(), r"Megatron-style model/tensor parallelism"),
])
def test_sp_refusals_name_the_key_before_any_collective(config, mpu, message):
    import ds_fssdp
    from ds_fssdp import FSSDPConfigError, FSSDPMoE
    model = torch.nn.Sequential(FSSDPMoE(hidden_size=4, ffn_hidden_size=8, num_experts=4))
    with pytest.raises(FSSDPConfigError, match=message):
        ds_fssdp.initialize(model=model, config=dict({"train_batch_size": 2, "fssdp": {}}, **config), mpu=mpu)
    assert not torch.distributed.is_initialized()
