"""The runtime's token path with the Triton kernels, run by the Triton interpreter on 2 gloo CPU
ranks, equals it with the torch reference: one step of the sharded layer (outputs, input, gate
and every expert's gradients, the replicas' reduced), and the permutation kernels are what ran.

The ranks start with TRITON_INTERPRET=1 (set around the spawn only): it must be set before
``import triton``, which DeepSpeed's import already does (triton's own library functions, such as
``tl.sum``, are jitted then). Each rank runs the same step under DS_FSSDP_OPS_BACKEND=torch and
=triton (the ops read the variable when they choose, and forget the choice when ``dispatch._chosen`` is cleared). The grouped GEMM switches with it, so the whole expert path is compared.
Tolerance: fp32, the two differ in summation order only (the GEMM's tiles, the kernels' row dot
products); 1e-6 absolute as in test_layer_distributed.py.
"""
import os

import pytest
import torch

from distributed import spawn
from test_layer_distributed import ATOL, CASES, _worker

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

WORLD = 2
# Two nodes of one rank with swiglu, and a rank without tokens with gelu.
RUN_CASES = [dict(CASES[1], tokens=CASES[1]["tokens"][:WORLD]), dict(CASES[2], tokens=CASES[2]["tokens"][:WORLD], rpn=1)]
KERNELS = ("gather", "combine", "combine_backward")


def _both_backends(rank, world):
    from ds_fssdp.ops import dispatch
    out = {}
    for backend in ("torch", "triton"):
        os.environ[dispatch.ENV] = backend
        dispatch._chosen.clear()
        calls = _count_kernel_calls() if backend == "triton" else {}
        out[backend] = _worker(rank, world, RUN_CASES)
        out[backend + "_calls"] = dict(calls)
        out[backend + "_chosen"] = dispatch.backend_for(torch.device("cpu"))
    return out


def _count_kernel_calls() -> dict:
    import importlib
    kernels = importlib.import_module("ds_fssdp.ops.triton.permute_kernels")
    assert kernels.INTERPRET, "the kernel module was imported before TRITON_INTERPRET was set"
    calls = {name: 0 for name in KERNELS}
    for name in KERNELS:
        def counted(*args, _fn=getattr(kernels, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(kernels, name, counted)
    return calls


def test_runtime_path_triton_equals_torch(monkeypatch):
    pytest.importorskip("triton", reason="the Triton backend needs triton (pip install triton)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the ranks, from their start
    results = spawn(WORLD, _both_backends, fresh=True)  # not forked: the fork server has imported triton
    for rank, res in enumerate(results):
        assert (res["torch_chosen"], res["triton_chosen"]) == ("torch", "triton")
        # Per case, one copy per destination (the default; one hop: 2 ranks, one per node): gathers
        # for the send buffer, the gate weights' and the receiver's expansion; combines for the
        # receiver's weighted combine, the sender's sum over destinations and the three gathers'
        # backwards; the two combines' own backwards.
        n = len(RUN_CASES)
        assert res["triton_calls"] == {"gather": 3 * n, "combine": 5 * n, "combine_backward": 2 * n}
        for ci, (want, got) in enumerate(zip(res["torch"], res["triton"])):
            where = f"rank {rank} case {ci}"
            for key in ("y", "l_aux", "x_grad", "gate_grad", "owned_grad"):
                torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=1e-5, msg=lambda m: f"{where} {key}: {m}")
            assert torch.equal(got["owned_E"], want["owned_E"])
            assert got["stats"]["replicas"] == want["stats"]["replicas"] > 0
