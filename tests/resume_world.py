"""Workers of the world-size-change checks in test_checkpoint.py: ZeRO 1/2/3 checkpoints saved on
one number of ranks and loaded on another (the dense part through DeepSpeed's universal
checkpoint, the experts keyed by (layer, expert)), and a ZeRO-3 round trip on the same ranks."""
import copy
import os

import torch

from toy import expert_rows
from training import MODEL, batch, ds_config

ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
NO_CSV = {"metrics_csv": None}
# name -> config keywords (the world size is the launch's); every run trains with clipping active.
# DeepSpeed's universal checkpoint carries Adam's moments only: the runs that change world size use AdamW.
RUNS = {"z1-adamw": dict(zero=1, gas=1, optimizer=ADAMW), "z3-adamw": dict(zero=3, gas=1, optimizer=ADAMW)}
# The same-world ZeRO-3 round trip: SGD, so the resumed run can be compared exactly.
ROUND_TRIP = {"z3-sgd": dict(zero=3)}
STEPS = 2  # the ZeRO-3 round trip: before the save and after it
SAVE_STEPS = 1  # the world-size changes: one AdamW step gives every moment a value


def config(name, world):
    return ds_config(world=world, fssdp=dict(NO_CSV), **{**RUNS, **ROUND_TRIP}[name])


def engine_for(name, world, seed=0):
    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    torch.manual_seed(seed)
    model = GPTMoE(MODEL)
    engine, *_ = ds_fssdp.initialize(model=model, config=copy.deepcopy(config(name, world)))
    return engine, model


def train(engine, rank, steps, start):
    losses = []
    for step in range(start, start + steps):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def full_state(engine, model) -> dict:
    """Everything a resume must restore, independent of the world size: every dense fp32 master
    and optimizer moment whole (DeepSpeed's tensor-fragment API; collective), every expert's
    compute weights, and this rank's expert rows (the test takes the union over ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    keys = sorted({k for st in engine.basic_optimizer.state.values() for k, v in st.items()
                   if torch.is_tensor(v) and v.dim() > 0})  # exp_avg and exp_avg_sq, or momentum_buffer
    dense, moments = {}, {}
    for n, p in engine.module.named_parameters():
        dense[n] = safe_get_full_fp32_param(p).detach().clone()
        for key in keys:
            moments[(n, key)] = safe_get_full_optimizer_state(p, key).detach().clone()
    return dict(dense=dense, moments=moments, rows=expert_rows(engine),
                experts=[{k: v.float() for k, v in l.export_experts().items()} for l in model.moe_layers()],
                global_steps=engine.global_steps, stage_steps=engine.fssdp.steps, lr=engine.get_lr())


def save_all(rank, world, root):
    """Train and save every run on this world; return the state each saved."""
    out = {}
    for name in RUNS:
        engine, model = engine_for(name, world)
        train(engine, rank, SAVE_STEPS, 0)
        engine.save_checkpoint(os.path.join(root, name), tag=f"on{world}")
        out[name] = full_state(engine, model)
        engine.fssdp.close()
    return out


def load_all(rank, world, root, saved_world):
    """Load every run's checkpoint of ``saved_world`` ranks into a fresh engine (other seed), take
    its state, then train one more step."""
    out = {}
    for name in RUNS:
        engine, model = engine_for(name, world, seed=1234)
        engine.load_checkpoint(os.path.join(root, name), tag=f"on{saved_world}")
        state = full_state(engine, model)
        state["next_losses"] = train(engine, rank, 1, SAVE_STEPS)
        out[name] = state
        engine.fssdp.close()
    return out


def zero3_round_trip(rank, world, root):
    """ZeRO-3 on the same ranks: the state right after a load equals the saved one, and training
    on continues exactly as the run that never stopped."""
    name = "z3-sgd"
    engine, model = engine_for(name, world)
    train(engine, rank, STEPS, 0)
    engine.save_checkpoint(os.path.join(root, "z3-same"), tag="a")
    saved = full_state(engine, model)
    cont = train(engine, rank, STEPS, STEPS)
    final = full_state(engine, model)
    engine.fssdp.close()
    fresh, fresh_model = engine_for(name, world, seed=99)
    fresh.load_checkpoint(os.path.join(root, "z3-same"), tag="a")
    loaded = full_state(fresh, fresh_model)
    resumed = train(fresh, rank, STEPS, STEPS)
    return dict(saved=saved, loaded=loaded, cont=cont, resumed=resumed, final=final,
                resumed_final=full_state(fresh, fresh_model))


def group_change(rank, world, root, *, saved_group=2, loaded_group=4):
    """A checkpoint saved with FSSDP groups of ``saved_group`` ranks (expert state partitioned over
    the EDP group) loaded into groups of ``loaded_group`` on the same ranks: the state before and
    after, and one more step."""
    import ds_fssdp
    from ds_fssdp.models import GPTMoE

    def engine_with(group, seed):
        torch.manual_seed(seed)
        model = GPTMoE(MODEL)
        cfg = ds_config(world=world, fssdp=dict(NO_CSV, group_size=group), zero=1, gas=1, optimizer=ADAMW)
        return (*ds_fssdp.initialize(model=model, config=cfg)[:1], model)

    def state(engine, model):
        # The same world: DeepSpeed's ZeRO-1 partitions are this rank's flat fp32 slices and their
        # moments (its fragment API links the moments only at the next step after a plain load).
        flat = [v.detach().clone() for st in engine.basic_optimizer.state.values() for k, v in sorted(st.items())
                if torch.is_tensor(v) and v.dim() > 0]
        return dict(dense={n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                    moments=flat, rows=expert_rows(engine), global_steps=engine.global_steps,
                    experts=[{k: v.float() for k, v in l.export_experts().items()} for l in model.moe_layers()],
                    stage_steps=engine.fssdp.steps, lr=engine.get_lr())

    engine, model = engine_with(saved_group, 0)
    assert engine.fssdp.expert_state.partitioned == (world // saved_group > 1)
    train(engine, rank, STEPS, 0)
    engine.save_checkpoint(os.path.join(root, "groups"), tag=f"g{saved_group}")
    saved = state(engine, model)
    if engine.fssdp.group_index != 0:  # every group owns every expert: count the first group's
        saved["rows"] = {k: v for k, v in saved["rows"].items() if k[1] is None}
    engine.fssdp.close()
    fresh, fresh_model = engine_with(loaded_group, 1234)
    fresh.load_checkpoint(os.path.join(root, "groups"), tag=f"g{saved_group}")
    loaded = state(fresh, fresh_model)
    loaded["next_losses"] = train(fresh, rank, 1, STEPS)
    fresh.fssdp.close()
    return dict(saved=saved, loaded=loaded)
