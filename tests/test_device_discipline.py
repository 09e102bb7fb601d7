"""What ``ds_fssdp.initialize`` puts into collectives, and where a layer's first experts come from
(4 gloo ranks, one spawn).

Device discipline: every tensor handed to a collective during ``initialize`` is on the engine's
device, and every FSSDP layer's experts were moved there before the first one (NCCL takes device
tensors only; a model handed over on the CPU would otherwise reach the scatter on the CPU). CPU
tests cannot tell a CPU tensor from a device tensor, so the order is recorded too: each layer's
``move_experts`` and every torch.distributed collective, in sequence. The negative control runs
initialize with the move removed and the same check fails.

Lazy experts (``FSSDPMoE(lazy_experts=True)``): initialize draws each rank's own experts only, and
at group sizes 4 and 2 every rank holds exactly the rows of the single-process layer built from the
same seed (bitwise); nothing is scattered for them.
"""
import pytest
import torch

from distributed import spawn

pytestmark = pytest.mark.distributed

WORLD = 4
COLLECTIVES = ("all_to_all_single", "broadcast", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather", "reduce", "send", "recv", "isend", "irecv")


def _net(lazy: bool):
    import torch.nn as nn

    from ds_fssdp.moe.layer import FSSDPMoE

    class Net(nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.moe = nn.ModuleList(FSSDPMoE(hidden_size=8, ffn_hidden_size=6, num_experts=8, k=2,
                                              activation="swiglu", bias=True, init_std=0.3, lazy_experts=lazy)
                                     for _ in range(2))

        def forward(self, x):
            x = self.inp(x)
            aux = 0
            for layer in self.moe:
                y, l_aux, _ = layer(x)
                x, aux = x + y, aux + l_aux
            return x.square().mean() + aux

    torch.manual_seed(0)
    return Net()


def _config(group_size: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * WORLD,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "fssdp": {"policy": "fssdp", "group_size": group_size, "materialization_budget": 2,
                      "metrics_csv": None}}


class Recorder:
    """Every torch.distributed collective's tensor devices and every layer's ``move_experts``, in
    order, while active."""

    def __init__(self, monkeypatch_move=True):  # False: the move is dropped (the negative control)
        self.events = []
        self._undo = []
        self.monkeypatch_move = monkeypatch_move

    def __enter__(self):
        import torch.distributed as tdist

        from ds_fssdp.moe.experts_module import FSSDPExperts
        for name in COLLECTIVES:
            original = getattr(tdist, name)

            def wrapped(*args, __name=name, __original=original, **kwargs):
                tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
                self.events.append(("collective", __name, {str(t.device) for t in tensors}))
                return __original(*args, **kwargs)

            setattr(tdist, name, wrapped)
            self._undo.append((tdist, name, original))
        move = FSSDPExperts.move_experts

        def recorded_move(layer, device):
            if self.monkeypatch_move:  # the control: initialize without its move
                self.events.append(("move", id(layer), str(device)))
                move(layer, device)

        FSSDPExperts.move_experts = recorded_move
        self._undo.append((FSSDPExperts, "move_experts", move))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def discipline_problems(events: list, layers: list, device) -> list:
    """What breaks the rule: a collective's tensor off ``device``, or a layer not moved to
    ``device`` before the first collective that carries a tensor."""
    problems = []
    first = next((i for i, e in enumerate(events) if e[0] == "collective" and e[2]), None)
    moved = {e[1] for e in events[:first] if e[0] == "move" and e[2] == str(device)}
    for i, layer in enumerate(layers):
        if id(layer) not in moved:
            problems.append(f"layer {i} was not moved to {device} before the first collective")
    for e in events:
        if e[0] == "collective" and e[2] - {str(device)}:
            problems.append(f"{e[1]} got tensors on {sorted(e[2])}, the engine's device is {device}")
    if first is None:
        problems.append("no collective carried a tensor")
    return problems


def worker(rank, world):
    import ds_fssdp
    import ds_fssdp.runtime.stage as stage_module
    from ds_fssdp.moe.layer import FSSDPMoE
    out = {}
    # Device discipline: a model handed over on the CPU (scattered from rank 0, broadcast over EDP).
    for name, move in (("moved", True), ("control", False)):
        net = _net(lazy=False)
        layers = [m for m in net.modules() if isinstance(m, FSSDPMoE)]
        with Recorder(monkeypatch_move=move) as rec:
            engine, *_ = ds_fssdp.initialize(model=net, model_parameters=net.parameters(), config=_config(2))
        out[name] = discipline_problems(rec.events, layers, engine.device)
        out[f"{name}_collectives"] = sum(e[0] == "collective" for e in rec.events)
    # Lazy experts: each rank's own rows, at two group sizes, against the single-process layers.
    reference = _net(lazy=True)
    for layer in reference.moe:
        layer.materialize_experts()  # the single-process reference: every expert, here
    full = [layer.spec.flatten(layer.export_experts()) for layer in reference.moe]
    for group_size in (4, 2):
        net = _net(lazy=True)
        assert all(layer.lazy for layer in net.moe)
        scattered = []
        real_scatter = stage_module.scatter_rows
        stage_module.scatter_rows = lambda *a, **k: scattered.append(1) or real_scatter(*a, **k)
        try:
            ds_fssdp.initialize(model=net, model_parameters=net.parameters(), config=_config(group_size))
        finally:
            stage_module.scatter_rows = real_scatter
        out[f"lazy_g{group_size}"] = [bool(torch.equal(layer.sharded.rows.detach(), f[layer.sharded.owned_E]))
                                      for layer, f in zip(net.moe, full)]
        out[f"lazy_g{group_size}_owned"] = [layer.sharded.owned_E.tolist() for layer in net.moe]
        out[f"lazy_g{group_size}_scatters"] = len(scattered)
    return out


def test_initialize_collectives_on_the_engine_device_and_lazy_experts():
    results = spawn(WORLD, worker)
    for rank, r in enumerate(results):
        assert r["moved"] == [], r["moved"]
        assert r["moved_collectives"] > 0
        assert r["control"] and all("was not moved" in p for p in r["control"]), r["control"]
        assert len(r["control"]) == 2
        for g in (4, 2):
            assert r[f"lazy_g{g}"] == [True, True], (rank, g)
            assert r[f"lazy_g{g}_scatters"] == 0, "lazy experts were scattered"
        assert r["lazy_g4_owned"] == [[2 * rank, 2 * rank + 1]] * 2
        assert r["lazy_g2_owned"] == [list(range(4 * (rank % 2), 4 * (rank % 2) + 4))] * 2


def test_discipline_check_sees_a_late_move():
    """The order matters: a move after the first collective is a problem even to the right device."""
    layers = [object()]
    late = [("collective", "all_to_all_single", {"cpu"}), ("move", id(layers[0]), "cpu")]
    assert discipline_problems(late, layers, torch.device("cpu")) == [
        "layer 0 was not moved to cpu before the first collective"]
    early = late[::-1]
    assert discipline_problems(early, layers, torch.device("cpu")) == []
    wrong = early + [("collective", "broadcast", {"cpu", "cuda:0"})]
    assert discipline_problems(wrong, layers, torch.device("cpu")) == [
        "broadcast got tensors on ['cpu', 'cuda:0'], the engine's device is cpu"]


def test_lazy_layer_rows_do_not_depend_on_how_they_are_split():
    """One process: the rows of any subset of experts are the full layer's rows (the per-expert
    generators), and a lazy layer allocates no expert storage."""
    from ds_fssdp.moe.layer import FSSDPMoE
    def build():
        torch.manual_seed(3)
        return FSSDPMoE(hidden_size=8, ffn_hidden_size=6, num_experts=8, activation="gelu", bias=True,
                        lazy_experts=True)

    full, lazy = build(), build()
    full.materialize_experts()
    assert not full.lazy and lazy.lazy and all(p.device.type == "meta" for p in lazy.expert_parameters())
    assert lazy.gate.weight.device.type == "cpu" and torch.equal(lazy.gate.weight, full.gate.weight)
    rows = full.spec.flatten(full.export_experts())
    assert torch.count_nonzero(rows) > rows.numel() // 2  # weights drawn, biases zero
    for owned in ([0, 1], [5], [2, 3, 6, 7]):
        assert torch.equal(lazy.fresh_rows(torch.tensor(owned)), rows[owned])
    with pytest.raises(RuntimeError, match="meta device until ds_fssdp.initialize"):
        lazy(torch.zeros(3, 8))
