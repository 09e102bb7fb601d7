"""Measured quantities for the "auto" knobs and calibration: link bandwidth, expert GEMM speed.

Legend: R rows, H hidden, D ranks.

Both measurements are short and collective-free except the bandwidth probe (one all-to-all, every
rank takes part). The attention window is measured per layer while training (ShardedExperts:
time from a layer's prefetch to its forward).
"""
from __future__ import annotations

import statistics
import time

import torch
from deepspeed import comm as dist

from ds_fssdp import ops
from ds_fssdp.moe.experts import ExpertSpec


def measure_link_bandwidth(*, group, agree_group, chunk_bytes: int, device, repeats: int = 3) -> float:
    """Bytes per second one rank moves in an all-to-all of ``chunk_bytes`` to every peer of
    ``group`` (median of ``repeats`` after one warm-up), the slowest over ``agree_group`` (None:
    the world; every rank of it calls this). One rank: infinite."""
    world = dist.get_world_size(group=group)
    if world == 1:
        return float("inf")
    n = max(1, chunk_bytes // 4)
    send = torch.zeros(world * n, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    seconds = median_seconds(lambda: dist.all_to_all_single(recv, send, group=group), repeats=repeats,
                             cuda=send.is_cuda, before=lambda: dist.barrier(group=group))
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=agree_group)  # one number
    return (world - 1) * n * 4 / float(t)


@torch.no_grad()
def measure_expert_flops(spec: ExpertSpec, *, dtype: torch.dtype, device, rows: int = 256, repeats: int = 3) -> float:
    """Achieved FLOP/s of one expert's MLP on ``rows`` rows (forward; backward costs twice)."""
    H = spec.shapes[spec.names[0]][0]
    x = torch.randn(rows, H, dtype=dtype, device=device)
    w = {n: torch.randn(1, *s, dtype=dtype, device=device) * 0.02 for n, s in spec.shapes.items()}
    seconds = median_seconds(lambda: ops.expert_mlp(x, w, [rows], activation=spec.activation,
                                                    act_params=spec.act_params), repeats=repeats, cuda=x.is_cuda)
    return 2.0 * spec.numel * rows / seconds


def median_seconds(fn, *, repeats: int, cuda: bool, before=None) -> float:
    """The median seconds of ``fn()`` over ``repeats`` runs after one warm-up (``before()`` untimed
    ahead of each run; ``cuda``: synchronize before reading the clock)."""
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
