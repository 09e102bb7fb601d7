"""FlexMoE (Nie et al., SIGMOD 2023) as the Themis paper describes it: persistent replicas with their
own optimizer state, expanded or shrunk one unit at a time until a balance threshold, replica
gradients all-reduced every iteration.

Legend: L layers, E experts, D ranks.

State: per layer, the persistent replicas beyond each expert's owner (bool [E, D]); each rank has
``flexmoe_slots`` reserved replica slots per layer (pre-allocated, counted in memory whether used or
not). Every ``flexmoe_interval`` iterations, with the predicted loads, while the balance ratio
(max / mean rank load, an expert's load split evenly over its holders) exceeds
``flexmoe_threshold``:

* expand: of the experts on the busiest rank, the one with the highest load per holder gets a
  replica on the least-loaded rank that lacks it and has a free slot; its parameters and optimizer
  state are copied from a holder (one in the destination's node if there is one, else the owner)
  on the critical path;
* if no such rank has a free slot, first shrink: drop the replica with the lowest load per holder
  (freeing its slot, no transfer), then expand;
* an operation that does not lower the busiest rank's load (or, at equal load, the number of
  ranks that carry it) is undone and the adjustment stops; at most E operations per layer per
  adjustment.

Owners never move (FlexMoE's migrate is a shrink + expand here).
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.baselines.base import LayerPlan, Policy, PolicyConfig, Reshard
from ds_fssdp.planner.shard import shard_placement


class FlexMoEPolicy(Policy):
    name = "flexmoe"

    def __init__(self, config: PolicyConfig, **kwargs):
        super().__init__(config, **kwargs)
        self._replicas_LED = torch.zeros(config.num_layers, config.num_experts, self.topology.num_ranks,
                                         dtype=torch.bool)

    @property
    def reserved_slots(self) -> int:
        return self.config.flexmoe_slots

    def persistent_ED(self, layer: int, owner_E: torch.Tensor) -> torch.Tensor:
        return self._replicas_LED[layer] & ~shard_placement(owner_E.to("cpu", torch.long), self.topology.num_ranks)

    def post_gating(self, layer: int, owner_E: torch.Tensor, placement_ED: torch.Tensor, *,
                    tokens_ED: torch.Tensor, clock=None) -> LayerPlan:
        return self._plan(owner_E, placement_ED, persistent_ED=self.persistent_ED(layer, owner_E))

    def reshard(self, step: int, history_load_LE: torch.Tensor | None, *, owner_LE: torch.Tensor,
                clock=None) -> Reshard | None:
        if history_load_LE is None or step % self.config.flexmoe_interval:
            return None
        owner_LE = owner_LE.to("cpu", torch.long)
        copies = []
        for l in range(owner_LE.shape[0]):
            copies += [(l, e, src, dst) for e, src, dst in self._adjust(l, owner_LE[l], history_load_LE[l])]
        return (Reshard(owner_LE=owner_LE, copies_M4=torch.tensor(copies, dtype=torch.long).view(-1, 4)) if copies
                else None)

    def _adjust(self, layer: int, owner_E: torch.Tensor, load_E: torch.Tensor) -> list:
        cfg, topo = self.config, self.topology
        load_E = load_E.to("cpu", torch.float64)
        shard_ED = shard_placement(owner_E, topo.num_ranks)
        rep_ED = self._replicas_LED[layer] & ~shard_ED
        node_D = topo.node_D()
        ratio = balance_ratio(shard_ED | rep_ED, load_E)
        key = _imbalance_key(shard_ED | rep_ED, load_E)
        copies = []
        for _ in range(load_E.numel()):
            if ratio <= cfg.flexmoe_threshold or cfg.flexmoe_slots == 0:
                break
            trial_ED = rep_ED.clone()
            holders_ED = shard_ED | trial_ED
            per_E = load_E / holders_ED.sum(1)
            busiest = int(torch.argmax(_rank_load_D(holders_ED, load_E)))
            expandable_E = holders_ED[:, busiest] & ~holders_ED.all(1) & (load_E > 0)
            if not bool(expandable_E.any()):
                break
            e = int(torch.argmax(torch.where(expandable_E, per_E, torch.full_like(per_E, -1.0))))
            free_D = cfg.flexmoe_slots - trial_ED.sum(0)
            if not bool((~holders_ED[e] & (free_D > 0)).any()):
                # Shrink the replica carrying the least load per holder (not of e itself).
                shrinkable_E = trial_ED.any(1)
                shrinkable_E[e] = False
                if not bool(shrinkable_E.any()):
                    break
                s = int(torch.argmin(torch.where(shrinkable_E, per_E, torch.full_like(per_E, float("inf")))))
                rank_load_D = _rank_load_D(holders_ED, load_E)
                on_D = trial_ED[s]
                drop = int(torch.argmax(torch.where(on_D, rank_load_D, torch.full_like(rank_load_D, -1.0))))
                trial_ED[s, drop] = False
                holders_ED = shard_ED | trial_ED
                free_D = cfg.flexmoe_slots - trial_ED.sum(0)
            candidates_D = ~holders_ED[e] & (free_D > 0)
            if not bool(candidates_D.any()):
                break
            rank_load_D = _rank_load_D(holders_ED, load_E)
            d = int(torch.argmin(torch.where(candidates_D, rank_load_D, torch.full_like(rank_load_D, float("inf")))))
            trial_ED[e, d] = True
            new_key = _imbalance_key(shard_ED | trial_ED, load_E)
            if new_key >= key:
                break
            same_node_D = holders_ED[e] & (node_D == node_D[d])
            src = int(torch.nonzero(same_node_D)[0]) if bool(same_node_D.any()) else int(owner_E[e])
            copies.append((e, src, d))
            rep_ED, key = trial_ED, new_key
            ratio = balance_ratio(shard_ED | rep_ED, load_E)
        self._replicas_LED[layer] = rep_ED
        return copies


def _rank_load_D(holders_ED: torch.Tensor, load_E: torch.Tensor) -> torch.Tensor:
    per_E = load_E / holders_ED.sum(1).clamp(min=1)
    return (holders_ED.double() * per_E[:, None]).sum(0)


def _imbalance_key(holders_ED: torch.Tensor, load_E: torch.Tensor) -> tuple:
    """(busiest rank's load, how many ranks carry it): lower is better balanced."""
    rank_load_D = _rank_load_D(holders_ED, load_E)
    top = float(rank_load_D.max())
    return (top, int((rank_load_D >= top * (1 - 1e-12)).sum()))


def balance_ratio(holders_ED: torch.Tensor, load_E: torch.Tensor) -> float:
    """max / mean rank load with each expert's load split evenly over its holders (1.0: balanced)."""
    rank_load_D = _rank_load_D(holders_ED, load_E.to("cpu", torch.float64))
    mean = float(rank_load_D.mean())
    return float(rank_load_D.max()) / mean if mean > 0 else 1.0
