"""FasterMoE (He et al., PPoPP 2022) dynamic shadowing, as the Themis paper describes it.

Legend: E experts, D ranks (source d, destination d2), C candidate experts.

Placement before gating is the EP shard. After gating, with the actual ``tokens_ED``, experts are
considered hottest first, in sweeps until a sweep shadows nothing more: expert e is shadowed (its
parameters broadcast to every rank, its gradient reduced back after the backward, both on the
critical path) if the latency model says the layer time it saves exceeds the extra broadcast +
reduce time. (Repeated sweeps matter: shadowing one expert can make an earlier-rejected one the
bottleneck. Picking the best-saving expert each round instead stalls on ties between bottleneck
ranks and shadows far fewer.) Latency model: the :class:`CostModel`'s layer time (slowest rank's compute + four
token exchanges); a shadowed expert is on every rank, so its tokens stay where they are and the
model updates the rank-to-rank flow instead of re-planning. The broadcast is the cost model's
relayed sparse collective (NCCL broadcasts are pipelined rings, so a node forwards what it
received). The final plan comes from the policy's dispatcher.
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.baselines.base import LayerPlan, Policy
from ds_fssdp.planner.shard import shard_placement


class FasterMoEPolicy(Policy):
    name = "fastermoe"

    def post_gating(self, layer: int, owner_E: torch.Tensor, placement_ED: torch.Tensor, *,
                    tokens_ED: torch.Tensor, clock=None) -> LayerPlan:
        cost = self.config.cost
        if cost is None:
            raise ValueError(f"{self.name}: shadowing needs PolicyConfig.cost")
        owner_E = owner_E.to("cpu", torch.long)
        tokens_ED = tokens_ED.to("cpu", torch.long)
        shard_ED = shard_placement(owner_E, self.topology.num_ranks)
        current_ED = placement_ED.to("cpu", torch.bool).clone()
        shadow_ED = torch.zeros_like(current_ED)
        cap = owner_E.numel() if self.config.fastermoe_max_shadow is None else self.config.fastermoe_max_shadow
        plan_EDD = self.dense_plan(current_ED, tokens_ED).double()
        local_EDD = torch.diag_embed(tokens_ED.double())  # each expert's plan once it is everywhere
        flow_DD = plan_EDD.sum(0)
        layer_s = float(cost.flow_layer_times(flow_DD[None])[0])
        bcast_s = 0.0
        order = [e for e in torch.sort(-tokens_ED.sum(1), stable=True).indices.tolist() if int(tokens_ED[e].sum()) > 0]
        pos, accepted_in_sweep = 0, False
        while int(shadow_ED.any(1).sum()) < cap:
            # The sequential sweep "for e in order[pos:]: shadow e if it pays", with the
            # candidates after ``pos`` evaluated in one batch against the current state.
            rest = [e for e in order[pos:] if not bool(current_ED[e].all())]
            found = None
            if rest:
                rest_C = torch.tensor(rest)
                trial_CDD = flow_DD[None] - plan_EDD[rest_C] + local_EDD[rest_C]
                saved_C = layer_s - cost.flow_layer_times(trial_CDD)
                for i in torch.nonzero(saved_C > 0).flatten().tolist():
                    trial_shadow_ED = shadow_ED.clone()
                    trial_shadow_ED[rest[i]] = ~current_ED[rest[i]]
                    trial_bcast_s = cost.broadcast_time(owner_E, shard_ED | trial_shadow_ED)
                    if float(saved_C[i]) > 2.0 * (trial_bcast_s - bcast_s):
                        found = (i, trial_shadow_ED, trial_bcast_s)
                        break
            if found is None:
                if not accepted_in_sweep:
                    break
                pos, accepted_in_sweep = 0, False  # another sweep: earlier experts may pay now
                continue
            i, shadow_ED, bcast_s = found
            e = rest[i]
            current_ED[e] = True
            flow_DD = trial_CDD[i]
            layer_s -= float(saved_C[i])
            plan_EDD[e] = local_EDD[e]
            pos, accepted_in_sweep = order.index(e) + 1, True
        return self._plan(owner_E, current_ED, shadow_ED=shadow_ED)
