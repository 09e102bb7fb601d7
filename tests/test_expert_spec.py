"""ExpertSpec: named expert tensors <-> one flat row per expert, with biases and activation
parameters; the re-materializing expert compute on such rows.

fp32 throughout; the row paths run the same ops as the named tensors, so they agree to
summation order (assert_close defaults).
"""
import pytest
import torch

from ds_fssdp import ops
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.remat import RematExpertMLP

H, Fh = 3, 5
GPTOSS = {"alpha": 1.702, "limit": 1.0}


@pytest.mark.parametrize("activation,names", [("gelu", ("w_a", "w_b")), ("swiglu", ("w_gate", "w_up", "w_down"))])
def test_specs_without_bias_keep_the_weights_only_row(activation, names):
    spec = ExpertSpec(activation, H, Fh)
    assert spec.names == names and spec.numel == len(names) * H * Fh and spec.act_params == {}
    tensors = {n: torch.randn(2, *spec.shapes[n]) for n in names}
    want = torch.cat([tensors[n].reshape(2, -1) for n in names], dim=1)
    assert torch.equal(spec.flatten(tensors), want)


@pytest.mark.parametrize("activation,act_params,names,shapes", [
    ("gelu", None, ("w_a", "w_b", "b_a", "b_b"), [(H, Fh), (Fh, H), (Fh,), (H,)]),
    ("gptoss", GPTOSS, ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"),
     [(H, Fh), (H, Fh), (Fh, H), (Fh,), (Fh,), (H,)]),
])
def test_biases_follow_the_weights_in_the_row(activation, act_params, names, shapes):
    spec = ExpertSpec(activation, H, Fh, bias=True, act_params=act_params)
    assert spec.names == names and [spec.shapes[n] for n in names] == shapes
    rows = torch.randn(4, spec.numel)
    views = spec.views(rows)
    assert all(v.data_ptr() >= rows.data_ptr() for v in views.values())  # views, no copies
    assert torch.equal(spec.flatten(views), rows)
    assert torch.equal(views[names[-1]], rows[:, -H:])  # the last bias closes the row


def test_describe_round_trip_and_older_metadata():
    spec = ExpertSpec("gptoss", H, Fh, bias=True, act_params=GPTOSS)
    again = ExpertSpec.from_description(spec.describe())
    assert again.describe() == spec.describe() and again.names == spec.names
    old = ExpertSpec.from_description({"activation": "swiglu", "hidden_size": H, "ffn_hidden_size": Fh})
    assert old.describe() == {"activation": "swiglu", "hidden_size": H, "ffn_hidden_size": Fh, "bias": False,
                              "act_params": {}}


def test_spec_rejects_bad_activation_and_params():
    with pytest.raises(ValueError, match=r"'gptoss' needs act_params \['alpha', 'limit'\]"):
        ExpertSpec("gptoss", H, Fh)
    with pytest.raises(ValueError, match=r"activation \('relu'\) must be one of"):
        ExpertSpec("relu", H, Fh)


def _mlp_inputs(spec, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(sizes), spec.numel, generator=gen).requires_grad_()
    x = torch.randn(sum(sizes), H, generator=gen).requires_grad_()
    dy = torch.randn(sum(sizes), H, generator=gen)
    return rows, x, dy


@pytest.mark.parametrize("sizes", [[2, 0, 3], [0, 4, 0]], ids=["middle-empty", "one-expert"])
def test_expert_mlp_on_rows_trains_the_biases_in_the_row(sizes):
    """Gradients through spec.views reach each expert's bias slice of its row, as they would for
    separate per-expert tensors (an empty expert's slice stays zero)."""
    spec = ExpertSpec("gptoss", H, Fh, bias=True, act_params=GPTOSS)
    rows, x, dy = _mlp_inputs(spec, sizes, 7)
    y = ops.expert_mlp(x, spec.views(rows), sizes, activation=spec.activation, act_params=spec.act_params)
    (g_rows,) = torch.autograd.grad(y, [rows], dy)
    named = {n: t.detach().clone().requires_grad_() for n, t in spec.views(rows).items()}
    outs, start = [], 0
    for e, n in enumerate(sizes):  # one expert at a time, on its own tensors
        one = {k: v[e:e + 1] for k, v in named.items()}
        outs.append(ops.expert_mlp(x[start:start + n], one, [n], activation="gptoss", act_params=GPTOSS))
        start += n
    grads = torch.autograd.grad(torch.cat(outs), list(named.values()), dy)
    torch.testing.assert_close(y, torch.cat(outs))
    torch.testing.assert_close(g_rows, spec.flatten(dict(zip(named, grads))))
    bias_part = g_rows[:, -(2 * Fh + H):]
    for e, n in enumerate(sizes):
        assert (bias_part[e] == 0).all() == (n == 0)


class _Source:
    """Stands in for ShardedExperts: hands back the replica rows and takes their gradient."""

    def __init__(self, replica):
        self.replica, self.grad = replica, None

    def rematerialized(self):
        return self.replica

    def replica_grad_ready(self, grad):
        self.grad = grad


def test_remat_uses_the_spec_activation_params_and_biases():
    spec = ExpertSpec("swiglu_limit", H, Fh, bias=True, act_params={"limit": 0.5})
    sizes = [3, 0, 2]
    rows, x, dy = _mlp_inputs(spec, sizes, 8)
    owned, replica = rows[:1].detach().requires_grad_(), rows[1:].detach()
    source = _Source(replica)
    y = RematExpertMLP.apply(x, owned, replica, source, spec, sizes)
    gx, g_owned = torch.autograd.grad(y, [x, owned], dy)
    want = ops.expert_mlp(x, spec.views(rows), sizes, activation=spec.activation, act_params=spec.act_params)
    wx, w_rows = torch.autograd.grad(want, [x, rows], dy)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(torch.cat([g_owned, source.grad]), w_rows)
