"""The layer shape and load skew the planner benchmarks share (planning.py, routing.py)."""
from __future__ import annotations

import argparse
import time

import torch

from ds_fssdp import Topology


def parser(doc: str, *, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--skew", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--json", default=None)
    return p


def topology(args) -> Topology:
    return Topology(num_ranks=args.ranks, ranks_per_node=args.ranks // args.nodes)


def skewed_share(args, gen: torch.Generator) -> torch.Tensor:
    """Expert shares: softmax of Gaussian logits scaled by ``--skew``."""
    return torch.softmax(torch.randn(args.experts, generator=gen) * args.skew, 0)


def routed_layer(args, *, rank: int = 1) -> dict:
    """One rank's top-k routing of ``--tokens`` tokens (``--top-k``) from the skewed distribution,
    every rank's counts of that shape (this rank's column being its routing), the joint placement
    (t = 8, m = 2) and this rank's local experts."""
    from ds_fssdp.planner import homogeneous_owner
    from ds_fssdp.planner.joint import joint_materialize

    E, D, K, T = args.experts, args.ranks, args.top_k, args.tokens
    topo = topology(args)
    gen = torch.Generator().manual_seed(0)
    share = skewed_share(args, gen)
    idx_TK = torch.multinomial(share, T * K, replacement=True, generator=gen).reshape(T, K)
    tokens_ED = torch.distributions.Multinomial(total_count=T * K, probs=share).sample((D, )).t().long()
    tokens_ED[:, rank] = torch.bincount(idx_TK.reshape(-1), minlength=E)
    owner_E = homogeneous_owner(E, D)
    placement_ED = joint_materialize(owner_E, tokens_ED.double(), topo, overlap_degree=8, budget=2)
    return {"topology": topo, "idx_TK": idx_TK, "tokens_ED": tokens_ED, "owner_E": owner_E,
            "placement_ED": placement_ED, "local_E": torch.nonzero(placement_ED[:, rank]).flatten()}


def sorted_times_us(fn, *, repeats: int, warmup: int = 10) -> list:
    """``fn``'s wall times in microseconds, ``repeats`` calls after ``warmup``, sorted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)
