"""FSSDP groups and expert-data-parallel groups (``fssdp.group_size``), built with deepspeed.comm.

Legend: W ranks in the world, G ranks per FSSDP group, N = W / G groups.

Consecutive ranks form an FSSDP group (group k: ranks k*G .. k*G + G - 1); each holds one complete
set of experts and runs everything FSSDP runs (planning, replicas, sparse collectives, token
exchange) inside itself. The ranks at the same position in every group (j, j + G, ...) own the
same experts: their expert-data-parallel (EDP) group averages those experts' gradients, and with
ZeRO stage >= 1 partitions their optimizer state (``runtime/expert_dp.py``).

With one group (the default) the token exchange keeps the default process group (None) and
there is no EDP group, exactly as before groups existed.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed import comm as dist

from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class FSSDPGroups:
    group_size: int
    num_groups: int
    group_index: int  # the FSSDP group this rank is in
    tokens: object  # this rank's FSSDP group: token exchange, count gathers, norms (None: the world)
    params: object  # the same ranks, for the sparse collectives (never queued behind the tokens)
    edp: object  # this rank's EDP group (None with one group)
    edp_ranks: tuple  # global ranks of this rank's EDP group, ascending
    topology: Topology  # the FSSDP group's nodes

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)

    def process_groups(self) -> list:
        """Every group the stage uses (None is the default group), for timeouts."""
        return [self.tokens, self.params] + ([self.edp] if self.edp is not None else [])


def fssdp_ranks(world: int, group_size: int) -> list:
    return [list(range(k * group_size, (k + 1) * group_size)) for k in range(world // group_size)]


def edp_ranks(world: int, group_size: int) -> list:
    return [list(range(j, world, group_size)) for j in range(group_size)]


def group_topology(group_size: int, ranks_per_node: int) -> Topology:
    """An FSSDP group spans whole nodes (G a multiple of ranks per node) or lies inside one."""
    return Topology(num_ranks=group_size, ranks_per_node=min(group_size, ranks_per_node))


def build_groups(*, world: int, rank: int, group_size: int, ranks_per_node: int) -> FSSDPGroups:
    """Create the process groups (collective: every rank calls it with the same sizes, already
    validated by ``FSSDPConfig.resolve_group_size``)."""
    topology = group_topology(group_size, ranks_per_node)
    index = rank // group_size
    if group_size == world:
        params = dist.new_group(ranks=list(range(world)))
        return FSSDPGroups(group_size=world, num_groups=1, group_index=0, tokens=None, params=params, edp=None,
                           edp_ranks=(rank, ), topology=topology)
    # torch requires every rank to create every group, in the same order.
    tokens = params = edp = None
    for k, ranks in enumerate(fssdp_ranks(world, group_size)):
        t, p = dist.new_group(ranks=ranks), dist.new_group(ranks=ranks)
        if k == index:
            tokens, params = t, p
    mine = ()
    for ranks in edp_ranks(world, group_size):
        g = dist.new_group(ranks=ranks)
        if rank in ranks:
            edp, mine = g, tuple(ranks)
    return FSSDPGroups(group_size=group_size, num_groups=world // group_size, group_index=index, tokens=tokens,
                       params=params, edp=edp, edp_ranks=mine, topology=topology)
