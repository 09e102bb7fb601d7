"""``ds_fssdp.initialize``: ``deepspeed.initialize`` plus the FSSDP stage for the experts.

Same signature and return value as ``deepspeed.initialize``. The ``"fssdp"`` section is read from
the same config DeepSpeed gets and validated before any collective runs. Expert parameters leave
the module before DeepSpeed sees it (DeepSpeed trains the dense rest as usual); the returned
engine is DeepSpeed's own, with ``backward`` and ``step`` extended to reduce, clip and step the
experts, so the user's ``engine.backward(loss); engine.step()`` loop is unchanged. A
``PipelineModule`` gets DeepSpeed's ``PipelineEngine``, whose ``train_batch`` runs FSSDP inside
every stage (``runtime/pipeline.py``).
"""
from __future__ import annotations

import functools
import os
from contextlib import nullcontext

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from deepspeed.utils import logger

from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.runtime.elastic import init_distributed
from ds_fssdp.runtime.expert_optimizer import check_expert_optimizer
from ds_fssdp.runtime.faults import install_from_env as install_faults
from ds_fssdp.runtime.groups import build_groups
from ds_fssdp.runtime.monitor import StageMonitor
from ds_fssdp.runtime.health import apply_run_settings, check_combinations, skipped_optimizer_step
from ds_fssdp.runtime import checkpoint, pipeline
from ds_fssdp.planner import sync_dtype
from ds_fssdp.runtime.sequence_parallel import sequence_parallel_size, sp_grad_scale
from ds_fssdp.runtime.tensor_parallel import attach_fold, tensor_parallel_size, tp_grad_scale
from ds_fssdp.runtime.stage import FSSDPStage
from ds_fssdp.runtime.zero3 import prepare_layers as prepare_zero3, zero_stage

# DeepSpeed's own initialize, captured at import: integrations may route deepspeed.initialize to
# ds_fssdp.initialize (the HF Trainer looks it up at call time), and this must not recurse.
_deepspeed_initialize = deepspeed.initialize


def initialize(args=None, model: torch.nn.Module = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Drop-in for ``deepspeed.initialize``; returns ``(engine, optimizer, dataloader, lr_scheduler)``."""
    ds_config = _read_config(args, config, config_params)
    fcfg = FSSDPConfig.from_ds_config(ds_config)
    layers = [m for m in model.modules() if isinstance(m, FSSDPExperts)] if model is not None else []
    pipe = isinstance(model, PipelineModule)  # a stage may hold no MoE layer: it still joins the collectives
    ds_kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                     training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                     mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                     mesh_param=mesh_param, config_params=config_params)
    if not fcfg.enabled or not (layers or pipe):
        if fcfg.enabled:
            logger.warning("fssdp: the model has no FSSDP experts (FSSDPMoE layers or converted HF experts); initializing plain DeepSpeed")
        return _deepspeed_initialize(**ds_kwargs)
    layout, whole, sp, tp = _check_before_collectives(ds_config, fcfg, model, layers, optimizer=optimizer, mpu=mpu,
                                                      mesh_param=mesh_param)
    requested, requested_by = requested_group_size(whole)

    init_distributed(backend=get_accelerator().communication_backend_name(), distributed_port=distributed_port,
                     dist_init_required=dist_init_required)  # restart-safe under torchrun
    # Every collective below runs on tensors of the device the engine will use (NCCL takes device
    # tensors only; DeepSpeed moves the model there only inside its own initialize, after the
    # stage has scattered): checked by tests/test_device_discipline.py.
    device = engine_device(args)
    for layer in layers:
        layer.move_experts(device)
    if any(l.sharded is not None for l in layers):
        raise FSSDPConfigError("fssdp: the model's FSSDPMoE layers are already sharded (initialize called twice?)")
    world = dist.get_world_size()
    ranks_per_node = fcfg.resolve_ranks_per_node(world)
    global_layers = None
    if pipe:  # FSSDP runs inside each stage's data-parallel ranks
        pipeline.check_stage_nodes(layout, ranks_per_node)
        group_size = fcfg.resolve_group_size(layout.dp_size, ranks_per_node, requested, requested_by,
                                             domain="the pipeline stage's data-parallel size")
        global_layers = pipeline.global_layer_indices(len(layers), layout)  # the first collective
        if not global_layers[1]:
            logger.warning("fssdp: no pipeline stage has FSSDP experts; initializing plain DeepSpeed")
            return _deepspeed_initialize(**ds_kwargs)
    else:
        group_size = fcfg.resolve_group_size(world, ranks_per_node, requested, requested_by)

    expert_ids = {id(p) for layer in layers for p in layer.expert_parameters()}
    # FSSDP groups and their expert-data-parallel groups; the sparse collectives get their own
    # process group, so an asynchronous gather or reduce never queues behind (or in front of) the
    # token exchanges.
    groups = build_groups(world=world, rank=dist.get_rank(), group_size=group_size, ranks_per_node=ranks_per_node,
                          stages=layout.stages if pipe else None)
    timed = groups.process_groups() + ([layout.dp_group, layout.pipe_group, None] if pipe else [])
    apply_run_settings(fcfg, groups=timed)  # collective timeout, deterministic mode
    # DeepSpeed's divisor of the summed gradients (SP and TP are never combined: refused; under
    # pipeline parallelism its data-parallel size).
    grad_scale = (1.0 / layout.dp_size if pipe else
                  sp_grad_scale(ds_config, world=world, sp=sp) if tp == 1 else tp_grad_scale(world=world, tp=tp))
    stage = FSSDPStage(layers, fcfg, groups, grad_scale=grad_scale, zero_stage=zero_stage(ds_config), layout=layout,
                       global_layers=global_layers)
    ds_kwargs["model_parameters"] = _without(model_parameters, expert_ids)
    if isinstance(optimizer, torch.optim.Optimizer):
        _strip_params(optimizer, expert_ids)

    engine, ds_optimizer, dataloader, scheduler = _deepspeed_initialize(**ds_kwargs)
    if tp > 1:  # AutoTP's groups exist once DeepSpeed has initialized
        from deepspeed.utils import groups as ds_groups
        tp_group = ds_groups.get_tensor_model_parallel_group()
        attach_fold(layers, tp_group=tp_group, tp_size=tp, tp_rank=dist.get_rank(group=tp_group))
    engine.__class__ = _fssdp_engine_class(type(engine))
    engine.fssdp = stage
    stage.attach(engine)
    if pipe:
        pipeline.attach(engine, layout)
    engine.fssdp_monitor = StageMonitor.for_engine(stage, engine)
    install_faults(engine)  # only when FSSDP_FAULTS is set (tests)
    return engine, ds_optimizer, dataloader, scheduler


def _check_before_collectives(ds_config: dict, fcfg: FSSDPConfig, model, layers: list, *, optimizer, mpu,
                              mesh_param) -> tuple:
    """Everything ``initialize`` refuses before its first collective, on every rank alike. Returns
    ``(pipeline layout or None, every stage's layers as one module, SP size, TP size)``."""
    for key in (sync_dtype.KEY, sync_dtype.SP_KEY):  # DeepSpeed refuses a bad one after the collectives
        sync_dtype.configured_dtype(ds_config, key)
    layout, whole, sp, tp = None, model, 1, 1
    if isinstance(model, PipelineModule):
        layout = pipeline.check_pipeline(ds_config, model, mpu=mpu, mesh_param=mesh_param)
        whole = pipeline.whole_model(model)  # every stage's layers: every rank refuses alike
        pipeline.check_layers(whole)
        check_combinations(ds_config, fcfg, model=whole)
    else:
        sp = check_supported(ds_config, fcfg, model=model, mpu=mpu, mesh_param=mesh_param)
        tp = tensor_parallel_size(ds_config)  # AutoTP: the FSSDP layers fold over its TP groups
    for layer in layers:  # a layer's own checks (integrations/peft_lora.py: LoRA on HF experts)
        if hasattr(layer, "prepare_initialize"):
            layer.prepare_initialize(ds_config, fcfg, model=model)
    prepare_zero3(layers, ds_config)  # it may refuse
    check_expert_optimizer(ds_config, optimizer, trains=any(m.trainable for m in whole.modules()
                                                            if isinstance(m, FSSDPExperts)))
    return layout, whole, sp, tp


def engine_device(args=None) -> torch.device:
    """The device DeepSpeed's engine will take (``DeepSpeedEngine._set_distributed_vars``): the
    accelerator's device of ``args.device_rank`` or LOCAL_RANK (set by every launcher and by
    ``deepspeed.init_distributed``)."""
    device_rank = getattr(args, "device_rank", None) if args is not None else None
    if device_rank is None:
        device_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", -1)))
    if device_rank >= 0:
        return torch.device(get_accelerator().device_name(device_rank))
    return torch.device(get_accelerator().current_device_name())


def requested_group_size(model) -> tuple:
    """The FSSDP group size the model's modules ask for (``fssdp_group_size``, set by
    ``ds_fssdp.MoE(ep_size=N)``) and who asks; (None, "") when none does. Different requests are
    refused by name."""
    asks = {}
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        size = getattr(m, "fssdp_group_size", None)
        if size is not None:
            asks.setdefault(int(size), f"{names.get(id(m)) or type(m).__name__}.ep_size")
    if len(asks) > 1:
        raise FSSDPConfigError("fssdp: the model's layers ask for different FSSDP group sizes: " +
                               ", ".join(f"{who} ({size})" for size, who in sorted(asks.items())) +
                               "; one group size applies to every layer")
    return next(iter(asks.items()), (None, ""))  # the one size asked for, and who asks


def check_supported(ds_config: dict, fcfg: FSSDPConfig, *, model, mpu, mesh_param=None) -> int:
    """Refuse combinations FSSDP does not handle, before any collective. Returns the Ulysses
    sequence-parallel size (1 without SP; runtime/sequence_parallel.py)."""
    stages = (ds_config.get("pipeline") or {}).get("stages", "auto")
    if isinstance(stages, int) and not isinstance(stages, bool) and stages > 1:
        raise FSSDPConfigError(f"pipeline.stages ({stages}): pipeline parallelism needs the model as a DeepSpeed "
                               f"PipelineModule (ds_fssdp.models.GPTMoEPipe, examples/train_gpt_moe.py "
                               f"--pipeline-stages); {type(model).__name__} is not one, and the Hugging Face Trainer "
                               "path has no pipeline (transformers has no pipeline path)")
    sp = sequence_parallel_size(ds_config, mpu=mpu, mesh_param=mesh_param)
    if mpu is not None and sp == 1:
        raise FSSDPConfigError("fssdp does not support Megatron-style model/tensor parallelism (an mpu other than "
                               "Ulysses sequence parallelism's was passed); experts are never split inside an expert")
    check_combinations(ds_config, fcfg, model=model)
    return sp


def _read_config(args, config, config_params) -> dict:
    cfg = config if config is not None else config_params
    if cfg is None and getattr(args, "deepspeed_config", None) is not None:
        cfg = args.deepspeed_config
    return {} if cfg is None else dict(load_ds_config(cfg))


def _without(params, drop_ids: set):
    """``model_parameters`` (tensors or param-group dicts) without the ``drop_ids`` tensors."""
    if params is None:
        return None
    return [dict(item, params=[p for p in item["params"] if id(p) not in drop_ids]) if isinstance(item, dict) else item
            for item in params if isinstance(item, dict) or id(item) not in drop_ids]


def _strip_params(optimizer: torch.optim.Optimizer, drop_ids: set) -> None:
    removed = 0
    for group in optimizer.param_groups:  # in place: the client's groups stay its own
        kept = [p for p in group["params"] if id(p) not in drop_ids]
        removed, group["params"] = removed + len(group["params"]) - len(kept), kept
    for p in [p for p in optimizer.state if id(p) in drop_ids]:
        del optimizer.state[p]
    if removed:
        logger.info(f"fssdp: moved {removed} expert parameters from the client optimizer to the FSSDP stage")


class FSSDPEngineMixin:
    """Extends DeepSpeed's engine (``engine.fssdp`` is the stage)."""

    def backward(self, loss, *args, **kwargs):
        self.fssdp.before_backward(self.is_gradient_accumulation_boundary())
        out = super().backward(loss, *args, **kwargs)
        self.fssdp.health.observe_loss(loss)
        self.fssdp.after_backward(loss.detach() if self.fssdp.trace is not None else None)
        return out

    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.fssdp.before_step(self)
        out = super().step(*args, **kwargs)
        if boundary:
            self.fssdp.after_step(self)
            self.fssdp_monitor.after_step(self)
        return out

    def clip_fp32_gradients(self):
        self.fssdp.norm.clip_dense_fp32(self)

    # -- robustness: non-finite steps and checkpoints (runtime/health.py, runtime/checkpoint/) --
    def _take_model_step(self, lr_kwargs, *args, **kwargs):
        """DeepSpeed's optimizer step, or its overflow path when the loss or gradients are not
        finite on some rank (every rank agrees: the decision uses the all-reduced norm)."""
        norm = self.fssdp.norm
        skip = self.fssdp.health.decide(norm.expert_sq if norm is not None else None, step=self.global_steps + 1,
                                        rank=dist.get_rank(), shards=self.fssdp.shards)
        with skipped_optimizer_step(self.optimizer) if skip else nullcontext():
            return super()._take_model_step(lr_kwargs, *args, **kwargs)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False,
                        *, async_save=False):
        """DeepSpeed's checkpoint plus every expert's state keyed by (layer, expert), written
        atomically (``latest`` moves only once the whole checkpoint is complete). ``async_save``:
        stage the whole state in host memory now and return; the files are written and committed
        in the background while training goes on (``wait_for_checkpoint``). A save first waits for
        the one before it."""
        self.fssdp.wait_in_flight()
        return checkpoint.save(self, save_dir, tag, client_state=client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters, async_save=async_save,
                               ds_save=super().save_checkpoint)

    def wait_for_checkpoint(self):
        """Block until a pending ``save_checkpoint(..., async_save=True)`` is committed; its error,
        on any rank, is raised on every rank. Collective (every rank calls); no-op when none is
        pending."""
        checkpoint.wait(self)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, *,
                        load_expert_optimizer_states=None, verify=True):
        """DeepSpeed's ``load_checkpoint`` (same arguments and return value) plus the experts,
        under this engine's world size and owners; every file is checked against the manifest
        and read with ``weights_only=True``. ``load_expert_optimizer_states`` (default: as
        ``load_optimizer_states``); ``verify``: check sha256 digests, not only sizes. A pending
        asynchronous save is committed first (it may be the checkpoint being loaded)."""
        self.fssdp.wait_in_flight()
        checkpoint.wait(self)
        return checkpoint.load(self, load_dir, tag, ds_load=super().load_checkpoint,
                               load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               custom_load_fn=custom_load_fn, load_expert_optimizer_states=load_expert_optimizer_states,
                               verify=verify)


@functools.cache
def _fssdp_engine_class(base: type) -> type:
    """``FSSDP<EngineClass>``, a subclass of the engine's own class; for DeepSpeed's pipeline engine
    also the pipeline mixin and its instruction map with the FSSDP work wrapped around the
    forward, backward and optimizer-step instructions (runtime/pipeline.py)."""
    if issubclass(base, PipelineEngine):
        return type(f"FSSDP{base.__name__}", (pipeline.FSSDPPipelineMixin, FSSDPEngineMixin, base),
                    {"_INSTRUCTION_MAP": pipeline.instruction_map(base._INSTRUCTION_MAP)})
    return type(f"FSSDP{base.__name__}", (FSSDPEngineMixin, base), {})
