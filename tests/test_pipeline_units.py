"""Pipeline parallelism's single-process pieces: the auxiliary loss injected into the backward, the
per-micro-batch records' order, and the refusals of the paths that have no pipeline."""
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from ds_fssdp.moe.aux_loss import AuxLossToBackward
from ds_fssdp.moe.records import MicrobatchRecords


def test_aux_loss_reaches_the_backward_once_with_the_scale():
    """x -> aux(x, l) gives l the gradient coef * scale, x's own unchanged; the total counts each
    forward once (a checkpoint's recompute inside the backward is not counted again)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    inject = AuxLossToBackward(coef=0.25)
    inject.scale = 0.5

    def block(x):
        l_aux = (w * x).sum() ** 2
        return x * 2.0, l_aux

    x = torch.randn(3, requires_grad=True)
    y = inject(*torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    (y.sum() * 0.5).backward()
    want_w = torch.autograd.grad(0.25 * 0.5 * (w * x).sum() ** 2, w)[0]
    torch.testing.assert_close(w.grad, want_w)
    torch.testing.assert_close(x.grad, torch.full((3, ), 1.0) + torch.autograd.grad(0.25 * 0.5 * (w * x).sum() ** 2,
                                                                                     x)[0])
    torch.testing.assert_close(inject.total, 0.25 * ((w * x).sum() ** 2).detach())


def test_aux_loss_without_a_scale_is_an_error():
    inject = AuxLossToBackward(coef=1.0)
    l_aux = torch.ones((), requires_grad=True)
    y = inject(torch.ones(2, requires_grad=True), l_aux * 2)
    with pytest.raises(RuntimeError, match="no loss scale was set"):
        y.sum().backward()


def test_records_are_first_in_first_out_across_micro_batches():
    """1F1B on stage 0 of 2: F0 F1 B0 F2 B1 F3 B2 B3; each backward gets its own forward's record,
    and inside one record the last recorded forward is replayed first."""
    rec = MicrobatchRecords()
    seen = []
    for event in ["F0", "F1", "B", "F2", "B", "F3", "B", "B"]:
        if event.startswith("F"):
            rec.begin_forward()
            rec.forward_record().iterations.extend([event + "a", event + "b"])
        else:
            r = rec.backward_record()
            seen.append((r.iterations.pop(), r.iterations.pop()))
            rec.end_backward()
    assert seen == [("F0b", "F0a"), ("F1b", "F1a"), ("F2b", "F2a"), ("F3b", "F3a")]
    assert len(rec) == 0


def test_records_without_declared_forwards_share_one_record():
    """Without pipeline parallelism every forward between two backwards is one micro-step."""
    rec = MicrobatchRecords()
    rec.forward_record().expected += 1
    rec.forward_record().expected += 1
    assert len(rec) == 1 and rec.backward_record().expected == 2
    rec.end_backward()
    assert rec.backward_record() is None and rec.current() is None


def test_pipeline_stages_without_a_pipeline_module_are_refused():
    """The HF Trainer path has no pipeline: a config asking for stages is refused by name (before any
    collective: no process group exists here)."""
    import ds_fssdp
    from ds_fssdp.config import FSSDPConfigError
    from ds_fssdp.models import GPTMoE, GPTMoEConfig
    model = GPTMoE(GPTMoEConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=1, ffn_hidden=8,
                                num_experts=2, k=1))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "pipeline": {"stages": 2}, "fssdp": {}}
    with pytest.raises(FSSDPConfigError, match=r"pipeline.stages \(2\): pipeline parallelism needs the model as a "
                                               r"DeepSpeed PipelineModule .*transformers has no pipeline path"):
        ds_fssdp.initialize(model=model, config=cfg)


def test_hf_convert_refuses_a_pipeline_module():
    from deepspeed.pipe import PipelineModule
    from ds_fssdp.integrations.hf import UnsupportedModelError, convert
    model = PipelineModule.__new__(PipelineModule)  # no grid: the refusal needs none
    nn.Module.__init__(model)
    with pytest.raises(UnsupportedModelError, match="PipelineModule; the Hugging Face path has no pipeline"):
        convert(model)


def test_auto_budget_counts_the_micro_batches_in_flight():
    """Stage s of S keeps min(G, S - s) micro-batches' replicas until their backward: every layer's
    each, or under RM the last layer's each plus two layers while one runs."""
    from ds_fssdp.planner.knobs import auto_materialization_budget, resident_layers
    assert resident_layers(4, rematerialize=False, in_flight=3) == 12
    assert resident_layers(4, rematerialize=True, in_flight=3) == 4
    assert resident_layers(1, rematerialize=True, in_flight=3) == 1
    assert auto_materialization_budget(memory_bytes=1200, expert_bytes=10, num_layers=4, rematerialize=False,
                                       in_flight=3) == 5
    assert auto_materialization_budget(memory_bytes=1200, expert_bytes=10, num_layers=4, rematerialize=True,
                                       in_flight=3) == 15
    with pytest.raises(ValueError, match=r"in_flight >= 1 \(0\)"):
        auto_materialization_budget(memory_bytes=1200, expert_bytes=10, num_layers=4, rematerialize=True, in_flight=0)
