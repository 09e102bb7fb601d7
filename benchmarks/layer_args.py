"""The layer shape and load skew the planner benchmarks share (planning.py, routing.py)."""
from __future__ import annotations

import argparse

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
