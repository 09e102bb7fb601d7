"""FSSDP groups and expert-data-parallel groups (``fssdp.group_size``), built with deepspeed.comm.

Legend: W ranks in the world, G ranks per FSSDP group, N = W / G groups.

Consecutive ranks form an FSSDP group (group k: ranks k*G .. k*G + G - 1); each holds one complete
set of experts and runs everything FSSDP runs (planning, replicas, sparse collectives, token
exchange) inside itself. The ranks at the same position in every group (j, j + G, ...) own the
same experts: their expert-data-parallel (EDP) group averages those experts' gradients, and with
ZeRO stage >= 1 partitions their optimizer state (``runtime/expert_dp.py``).

With one group (the default) the token exchange keeps the default process group (None) and
there is no EDP group, exactly as before groups existed.

Under pipeline parallelism (``runtime/pipeline.py``) the same layout is built inside each stage's
data-parallel ranks (``stages``: every stage's ranks, consecutive), stage after stage, on every
rank in the same order (``new_group`` is collective over the world): each stage's MoE layers train
over its own FSSDP and EDP groups, and the token exchange never uses the default group.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed import comm as dist

from ds_fssdp.moe.pipeline import ExchangeGroups
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
    exchange: ExchangeGroups | None = None  # the chunked token exchange's intra- and inter-node groups

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)

    def process_groups(self) -> list:
        """Every group the stage uses (None is the default group), for timeouts."""
        ex = [] if self.exchange is None else [g for g in (self.exchange.intra, self.exchange.inter) if g is not None]
        return [self.tokens, self.params] + ([self.edp] if self.edp is not None else []) + ex


def group_rank(rank: int, group_size: int) -> int:
    """A global rank's position in its FSSDP group (groups are consecutive ranks): what the loaders
    ask ``planner.initial_ownership`` with before the groups exist."""
    return rank % group_size


def group_topology(group_size: int, ranks_per_node: int) -> Topology:
    """An FSSDP group spans whole nodes (G a multiple of ranks per node) or lies inside one."""
    return Topology(num_ranks=group_size, ranks_per_node=min(group_size, ranks_per_node))


def build_groups(*, world: int, rank: int, group_size: int, ranks_per_node: int,
                 stages: list | None = None) -> FSSDPGroups:
    """Create the process groups (collective: every rank calls it with the same sizes, already
    validated by ``FSSDPConfig.resolve_group_size``). ``stages``: each pipeline stage's ranks
    (global, consecutive; their number a multiple of ``group_size``), or None: one stage of all. With
    one group of the whole world the token exchange keeps the default group; otherwise the groups are
    built inside every stage, stage after stage (torch requires every rank to create every group, in
    the same order), and this rank's stage's are returned."""
    if stages is None and group_size == world:
        params = dist.new_group(ranks=list(range(world)))
        return FSSDPGroups(group_size=world, num_groups=1, group_index=0, tokens=None, params=params, edp=None,
                           edp_ranks=(rank, ), topology=group_topology(group_size, ranks_per_node),
                           exchange=build_exchange_groups(world=world, rank=rank, group_size=world,
                                                          ranks_per_node=ranks_per_node))
    mine = None
    for ranks in (stages if stages is not None else [range(world)]):
        ranks = list(ranks)
        blocks = [ranks[k:k + group_size] for k in range(0, len(ranks), group_size)]
        tokens = params = edp = None
        for block in blocks:
            t, p = dist.new_group(ranks=block), dist.new_group(ranks=block)
            if rank in block:
                tokens, params = t, p
        edp_mine = (rank, )
        if len(blocks) > 1:
            for j in range(group_size):
                members = ranks[j::group_size]
                g = dist.new_group(ranks=members)
                if rank in members:
                    edp, edp_mine = g, tuple(members)
        exchange = build_exchange_groups(world=len(ranks), rank=rank, group_size=group_size,
                                         ranks_per_node=ranks_per_node, domain=ranks)
        if rank in ranks:
            mine = FSSDPGroups(group_size=group_size, num_groups=len(blocks),
                               group_index=ranks.index(rank) // group_size, tokens=tokens, params=params, edp=edp,
                               edp_ranks=edp_mine, topology=group_topology(group_size, ranks_per_node),
                               exchange=exchange)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the stages {stages}")
    return mine


def build_exchange_groups(*, world: int, rank: int, group_size: int, ranks_per_node: int,
                          domain: list | None = None) -> ExchangeGroups:
    """The chunked token exchange's communicators (``moe/pipeline.py``), collective: per FSSDP
    group one per node (same-node pairs; with one node the whole FSSDP group) and, with more than
    one node, one more over the FSSDP group's ranks (cross-node pairs). Separate communicators are
    separate queues (NCCL: streams), so intra- and inter-node chunks do not wait for each other.
    ``domain``: the ranks cut into FSSDP groups (``world`` of them; None: ``range(world)``)."""
    G = group_topology(group_size, ranks_per_node).ranks_per_node
    intra = inter = None
    domain = list(range(world)) if domain is None else list(domain)
    for ranks in (domain[k:k + group_size] for k in range(0, world, group_size)):
        for n in range(group_size // G):
            g = dist.new_group(ranks=ranks[n * G:(n + 1) * G])
            if rank in ranks[n * G:(n + 1) * G]:
                intra = g
        if group_size > G:
            g = dist.new_group(ranks=ranks)
            if rank in ranks:
                inter = g
    return ExchangeGroups(intra=intra, inter=inter, ranks_per_node=G)
