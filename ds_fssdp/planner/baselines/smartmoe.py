"""SmartMoE (Zhai et al., ATC 2023) as the Themis paper describes it: every N iterations, permute
experts between placement slots from the load history, moving parameters and optimizer state.

Legend: L layers, E experts, D ranks.

Each rank keeps its number of slots per layer (E / D under the homogeneous start), so memory stays
the EP memory. The new assignment is longest-processing-time first on the predicted loads
(hottest expert to the least-loaded rank with a free slot; ties to the lower rank), which does not
look at nodes, the way SmartMoE balances device loads. Its ranks are then renamed to keep the most
experts in place; every expert that still changes rank is a migration on the critical path. The
policy does not weigh the migration against its benefit (paper section 5.2).
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.baselines.base import Policy, Reshard
from ds_fssdp.planner.baselines.relabel import moved_copies, relabel_owner


class SmartMoEPolicy(Policy):
    name = "smartmoe"

    def reshard(self, step: int, history_load_LE: torch.Tensor | None, *, owner_LE: torch.Tensor,
                clock=None) -> Reshard | None:
        if history_load_LE is None or step == 0 or step % self.config.smartmoe_interval:
            return None
        owner_LE = owner_LE.to("cpu", torch.long)
        D = self.topology.num_ranks
        new_LE = owner_LE.clone()
        for l in range(owner_LE.shape[0]):
            load_E = history_load_LE[l].to("cpu", torch.float64)
            lpt_E = lpt_with_slots(load_E, torch.bincount(owner_LE[l], minlength=D))
            if _max_rank_load(lpt_E, load_E, D) < _max_rank_load(owner_LE[l], load_E, D) * (1 - 1e-9):
                new_LE[l] = relabel_owner(owner_LE[l], lpt_E, self.topology, keep_nodes=False)
        copies_M4 = moved_copies(owner_LE, new_LE)
        return Reshard(owner_LE=new_LE, copies_M4=copies_M4) if copies_M4.shape[0] else None


def lpt_with_slots(load_E: torch.Tensor, slots_D: torch.Tensor) -> torch.Tensor:
    """owner_E: hottest expert first to the least-loaded rank with a free slot (ties: lower rank)."""
    load_E = load_E.to("cpu", torch.float64)
    free_D = slots_D.to("cpu", torch.long).clone()
    if int(free_D.sum()) != load_E.numel():
        raise ValueError(f"slots ({int(free_D.sum())}) must equal the number of experts ({load_E.numel()})")
    rank_load_D = torch.zeros(free_D.numel(), dtype=torch.float64)
    owner_E = torch.empty(load_E.numel(), dtype=torch.long)
    for e in torch.sort(-load_E, stable=True).indices.tolist():
        masked_D = torch.where(free_D > 0, rank_load_D, torch.full_like(rank_load_D, float("inf")))
        d = int(torch.argmin(masked_D))  # first minimum: the lower rank on ties
        owner_E[e] = d
        free_D[d] -= 1
        rank_load_D[d] += load_E[e]
    return owner_E


def _max_rank_load(owner_E: torch.Tensor, load_E: torch.Tensor, num_ranks: int) -> float:
    return float(torch.zeros(num_ranks, dtype=torch.float64).index_add_(0, owner_E, load_E).max())
