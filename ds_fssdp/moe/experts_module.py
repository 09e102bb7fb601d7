"""FSSDPExperts: the experts half of an MoE layer, behind transformers' experts contract.

Legend: T tokens, H hidden, F expert FFN hidden, E experts, K top-k.

``forward(x_TH, idx_TK, weights_TK) -> y_TH`` with ``y_TH[t] = sum_k weights_TK[t, k] *
expert_{idx_TK[t, k]}(x_TH[t])``: the routing is given (by our gate, or by a Hugging Face
family's own router), the planner's loads come from ``idx_TK``. Before ``ds_fssdp.initialize``
(and on one rank) the module is ordinary and holds every expert as a [E, ...] parameter named
by its :class:`ExpertSpec`; ``initialize`` replaces them by a :class:`ShardedExperts` holding
only the experts this rank owns. Frozen experts (every expert tensor ``requires_grad=False``)
stay frozen once sharded.

In docs/design.md: the routing bias (section 4, :meth:`bind_router_bias`: DeepSeek-V3's
auxiliary-loss-free balancing, at ``fssdp.router_bias_update_rate`` when set, else the rate given
at binding), and in section 5 tensor-parallel folding (``fold``), owned rows read by a loader
before initialize (:meth:`adopt_owned_rows`, :meth:`keep_flags`) and lazy modules
(:meth:`fresh_rows`; :meth:`initial_rows` is what the stage asks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ds_fssdp.comm import fold as tp_fold
from ds_fssdp.moe.compute import dispatch_compute_combine, local_exchange, mlp_fn
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.routing import route


@dataclass
class OwnedRows:
    """The experts a rank owns before ``ds_fssdp.initialize`` (rows in the spec's order)."""
    owner_E: torch.Tensor  # long [E]: every expert's owner in its FSSDP group
    owned_E: torch.Tensor  # long [S]: the experts held here, ascending
    rows_SP: torch.Tensor  # [S, P]
    requires_grad: bool
    group_rank: int  # this rank's position in its FSSDP group (planner.initial_ownership)


class FSSDPExperts(nn.Module):

    def __init__(self, *, spec: ExpertSpec, hidden_size: int, ffn_hidden_size: int, num_experts: int, device=None,
                 dtype=None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts ({num_experts}) must be >= 1")
        self.spec = spec
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        for name, shape in spec.shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(num_experts, *shape, device=device,
                                                                   dtype=dtype)))
        self.k = None  # top-k, when known (the trace records it)
        self.sharded = None
        self._local_stats = {}
        self._router_bias = None  # (tensor [E], where, its own update rate) from bind_router_bias
        self.router_bias_update_rate = 0.0  # fssdp.router_bias_update_rate, set by the FSSDP stage (0: unset)
        self.pending_load_E = None  # float64 [E]: loads since the last bias update
        self.fold = None  # comm.fold.TPFold under AutoTP (set at initialize): dispatch this TP rank's slice
        # moe.side.SharedSide: the block's shared experts, computed beside a chunked exchange (bound by
        # integrations/hf.py's convert where the block runs them after its experts); None: none
        self.side = None
        self.owned = None  # OwnedRows read by a loader before initialize (adopt_owned_rows)

    @property
    def activation(self) -> str:
        return self.spec.activation

    @property
    def trainable(self) -> bool:
        """Whether the experts train: every expert tensor requires grad (or none does)."""
        if self.sharded is not None:
            return self.sharded.trainable
        params = [self._parameters.get(n) for n in self.spec.names]
        if self.owned is not None and all(p is None for p in params):
            return self.owned.requires_grad
        # Owned rows keep their full tensors as meta stand-ins (keep_flags): what froze those froze the experts.
        flags = {p.requires_grad for p in params if p is not None}
        if len(flags) > 1:
            raise ValueError(f"{type(self).__name__}: some expert tensors require grad and others do not "
                             f"({ {n: getattr(self, n).requires_grad for n in self.spec.names} }); an expert's "
                             "tensors train or freeze together")
        return flags.pop()

    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.route_and_compute(x_TH, idx_TK, weights_TK)

    def route_and_compute(self, x_TH, idx_TK, weights_TK, counts_E=None) -> torch.Tensor:
        """``y_TH`` (``counts_E``: the gate's, None: counted here). Folded over a TP group: routed
        full, this TP rank's slice through the sharded layer, the outputs all-gathered over the TP
        group (the loads count every token once: the FSSDP groups span the TP lanes)."""
        if self.fold is not None and self.sharded is not None:
            f = self.fold
            out_CH = self._route_and_compute(tp_fold.split(x_TH, f), tp_fold.split(idx_TK, f),
                                             tp_fold.split(weights_TK, f))
            return tp_fold.gather(out_CH, f, x_TH.shape[0])
        return self._route_and_compute(x_TH, idx_TK, weights_TK, counts_E)

    def lora_factors(self):
        """This forward's LoRA factors of the experts: a callable local_E -> factors by weight name
        (``ops.lora``), or None (none; ``integrations/hf_experts.py``: its PEFT wrappers' adapters)."""
        return None

    @property
    def side_ratio(self) -> float:
        """Expert rows per token of the work this layer computes beside its exchange (0: none; the
        block computes its shared experts itself)."""
        if self.side is None or self.sharded is None or self.fold is not None or not self.sharded.options.side:
            return 0.0
        return self.side.ratio

    def _route_and_compute(self, x_TH, idx_TK, weights_TK, counts_E=None) -> torch.Tensor:
        if counts_E is None:
            counts_E = torch.bincount(idx_TK.reshape(-1), minlength=self.num_experts)
        lora = self.lora_factors()
        if self.sharded is None:
            self._check_whole("forward")
            out_TH, load_E = self._local_forward(x_TH, idx_TK, weights_TK, counts_E, lora), counts_E
        else:
            side = self.side.work(x_TH) if self.side_ratio else None  # the block's input, unfolded
            out_TH, tokens_ED = self.sharded.forward(x_TH, idx_TK, weights_TK, counts_E, observe=self.training,
                                                     side=side, lora=lora)
            load_E = None if tokens_ED is None else tokens_ED.sum(1)  # None: a recompute (counted once)
        if self.training and load_E is not None:
            self.observe_load(load_E)
        return out_TH

    def _local_forward(self, x_TH, idx_TK, weights_TK, counts_E, lora=None):
        counts_E = counts_E.cpu()
        r = route(idx_TK, counts_E.view(-1, 1, 1), rank=0, local_E=torch.arange(self.num_experts))
        weights = {name: getattr(self, name) for name in self.spec.names}
        self._local_stats = {"replicas": 0, "expert_bytes": self.spec.numel * weights[self.spec.names[0]].element_size(),
                             "gather_bytes": 0, "reduce_bytes": 0, "tokens_per_rank": [int(counts_E.sum())],
                             "straggler": 1.0, "ep_straggler": 1.0}
        expert_fn = mlp_fn(weights, self.spec.activation, act_params=self.spec.act_params,
                           lora=lora(torch.arange(self.num_experts)) if lora is not None else None)
        return dispatch_compute_combine(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=local_exchange)

    @property
    def last_stats(self) -> dict:
        """Statistics of the last iteration: ``replicas`` (|P' \\ P|), ``expert_bytes`` (Psi),
        ``gather_bytes`` / ``reduce_bytes`` (group totals of the sparse collectives),
        ``tokens_per_rank`` (rows computed per rank), ``straggler`` (max / mean of those rows) and
        ``ep_straggler`` (the same for the shard placement alone)."""
        return dict(self.sharded.stats) if self.sharded is not None else dict(self._local_stats)

    # -- sharding --------------------------------------------------------------------------------
    def attach_sharded(self, sharded) -> None:
        """Hand the experts to a :class:`ShardedExperts` (called by ``ds_fssdp.initialize``)."""
        for name in self.spec.names:
            self._parameters.pop(name, None)
        self.owned = None
        self.sharded = sharded

    def expert_parameters(self) -> list:
        """The expert parameters the module shows until sharded (full tensors, lazy ones, or an owned
        module's meta stand-ins: ``keep_flags``): what ``initialize`` keeps out of DeepSpeed's optimizer."""
        held = [] if self.sharded is not None else [self._parameters.get(n) for n in self.spec.names]
        return [p for p in held if p is not None]

    @property
    def lazy(self) -> bool:
        """Expert tensors built on the meta device, not owned yet: ``initialize`` draws the owned
        experts' initial values (:meth:`fresh_rows`)."""
        params = [self._parameters.get(n) for n in self.spec.names]
        return self.sharded is None and self.owned is None and all(p is not None and p.is_meta for p in params)

    def adopt_owned_rows(self, owned: OwnedRows) -> None:
        """Hold only this rank's experts (rows of ``owned.owned_E``) until ``initialize``: the full
        ``[E, ...]`` tensors leave the module (a loader built them on the meta device)."""
        if self.sharded is not None:
            raise RuntimeError(f"{type(self).__name__}: already sharded by ds_fssdp.initialize")
        if tuple(owned.rows_SP.shape) != (owned.owned_E.numel(), self.spec.numel):
            raise ValueError(f"owned rows {tuple(owned.rows_SP.shape)} do not match {owned.owned_E.numel()} experts of "
                             f"{self.spec.numel} elements")
        for name in self.spec.names:
            self._parameters.pop(name, None)
        self.owned = owned

    def keep_flags(self) -> None:
        """Owned rows: show the full expert tensors as parameters on the meta device (no storage), so
        that what freezes a model's parameters (``requires_grad_(False)``, PEFT's base-model freeze)
        reaches these experts as it reaches a module holding them all; :attr:`trainable` reads them."""
        if self.owned is None:
            raise RuntimeError(f"{type(self).__name__}.keep_flags: the module holds no owned rows")
        dtype = self.owned.rows_SP.dtype
        for name, shape in self.spec.shapes.items():
            self._parameters[name] = nn.Parameter(torch.empty(self.num_experts, *shape, device="meta", dtype=dtype),
                                                  requires_grad=self.owned.requires_grad)

    def initial_rows(self, owner_E: torch.Tensor, owned_E: torch.Tensor, *, group_rank: int):
        """What ``initialize`` starts this layer from, when the module already has it: the owned
        rows a loader read (checked against the stage's owners), or fresh rows of the owned experts
        of a lazy module; None when the module holds every expert (the stage scatters them)."""
        if self.owned is not None:
            o = self.owned
            if not torch.equal(o.owner_E.cpu(), owner_E.cpu()) or o.group_rank != group_rank:
                raise ValueError(
                    f"{type(self).__name__}: the experts were read for the owners {o.owner_E.tolist()} at position "
                    f"{o.group_rank} of the FSSDP group, but initialize plans {owner_E.tolist()} at position "
                    f"{group_rank}: load the model with the same fssdp.group_size and world size as training")
            return o.rows_SP
        return self.fresh_rows(owned_E) if self.lazy else None

    def fresh_rows(self, owned_E: torch.Tensor) -> torch.Tensor:
        """Initial rows [S, P] of the experts ``owned_E`` of a lazy module, each expert from its own
        generator (the same values at any world or group size). Subclasses that can be lazy define it."""
        raise NotImplementedError(f"{type(self).__name__} was built with its expert tensors on the meta device "
                                  "but has no per-expert initializer (fresh_rows)")

    @torch.no_grad()
    def materialize_experts(self) -> None:
        """A lazy module's every expert, here (one process): the single-process reference of what
        ``initialize`` draws, rank by rank, at any world and group size."""
        if not self.lazy:
            raise RuntimeError(f"{type(self).__name__}.materialize_experts: the expert tensors are not lazy")
        requires_grad = self.trainable
        views = self.spec.views(self.fresh_rows(torch.arange(self.num_experts)))
        for name in self.spec.names:
            self._parameters[name] = nn.Parameter(views[name].clone(), requires_grad=requires_grad)

    def move_experts(self, device) -> None:
        """Put the expert tensors this module holds (full or owned) on ``device``: ``initialize``
        does it before its first collective (NCCL takes device tensors only)."""
        if self.owned is not None:
            self.owned.rows_SP = self.owned.rows_SP.to(device)
            return
        if self.sharded is not None or self.lazy:
            return
        with torch.no_grad():
            for name in self.spec.names:
                param = self._parameters[name]
                param.data = param.data.to(device)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.owned is not None:  # .to() / .cuda() / .half() move the owned rows too
            self.owned.rows_SP = fn(self.owned.rows_SP)
        return out

    def _check_whole(self, what: str) -> None:
        if self.owned is not None:
            raise RuntimeError(f"{type(self).__name__}.{what}: this rank holds only its own experts "
                               f"({self.owned.owned_E.tolist()} of {self.num_experts}) until ds_fssdp.initialize; "
                               "initialize first (the HF Trainer does), or save with "
                               "ds_fssdp.integrations.hf.save_pretrained")
        if self.lazy:
            raise RuntimeError(f"{type(self).__name__}.{what}: the expert tensors are on the meta device until "
                               "ds_fssdp.initialize draws each rank's own experts")

    @torch.no_grad()
    def export_experts(self) -> dict:
        """Full expert tensors by name ([E, ...]) on every rank; collective once sharded."""
        if self.sharded is None:
            self._check_whole("export_experts")
            return {name: getattr(self, name).detach().clone() for name in self.spec.names}
        views = self.spec.views(self.sharded.export_rows())
        return {name: v.clone() for name, v in views.items()}

    @torch.no_grad()
    def expert_rows(self) -> torch.Tensor:
        """The full expert tensors as rows [E, P] (one copy; the module must hold them all)."""
        self._check_whole("expert_rows")
        return self.spec.flatten({name: getattr(self, name).detach() for name in self.spec.names})

    # -- routing bias ----------------------------------------------------------------------------
    def bind_router_bias(self, owner: nn.Module, name: str, *, where: str, update_rate: float = 0.0) -> None:
        """Let the optimizer step move ``owner``'s buffer or parameter ``name`` (a router's [E]
        selection bias, updated in place) by ``update_rate`` unless ``fssdp.router_bias_update_rate``
        sets the rate. Bound by name, not by tensor: a move (``.to``, ``.cuda``, ``.half``) replaces
        the owner's tensor, and the rule must move the one the router reads."""
        bias_E = _tensor_of(owner, name)
        if bias_E is None or tuple(bias_E.shape) != (self.num_experts, ):
            shape = None if bias_E is None else tuple(bias_E.shape)
            raise ValueError(f"{where}: router bias of shape {shape}, expected ({self.num_experts},)")
        if not update_rate >= 0:
            raise ValueError(f"{where}: bias update rate ({update_rate}) must be >= 0")
        self._router_bias = ((owner, name), where, float(update_rate))  # a tuple: no submodule registered

    @property
    def router_bias(self):
        return None if self._router_bias is None else _tensor_of(*self._router_bias[0])

    @property
    def bias_update_rate(self) -> float:
        """The bound bias's rate: the config's when set, else its own (0 without a bias)."""
        return 0.0 if self._router_bias is None else self.router_bias_update_rate or self._router_bias[2]

    def observe_load(self, load_E: torch.Tensor) -> None:
        if not self.bias_update_rate:
            return
        if self.pending_load_E is None:
            self.pending_load_E = torch.zeros(self.num_experts, dtype=torch.float64)
        self.pending_load_E += load_E.detach().to("cpu", torch.float64)

    def pending_loads(self) -> list:
        """The load tensors accumulated since the last bias update (summed over FSSDP groups by
        the stage before :meth:`update_routing_bias`)."""
        return [self.pending_load_E] if self.pending_load_E is not None else []

    @torch.no_grad()
    def update_routing_bias(self) -> None:
        """DeepSeek-V3's rule, once per optimizer step (``ds_fssdp``'s engine calls it; a
        single-process loop calls it after ``optimizer.step()``)."""
        load_E, self.pending_load_E = self.pending_load_E, None
        if load_E is None or self._router_bias is None or float(load_E.sum()) <= 0:
            return
        bias_E = self.router_bias
        step_E = self.bias_update_rate * torch.sign(load_E.mean() - load_E)
        bias_E.add_(step_E.to(device=bias_E.device, dtype=bias_E.dtype))


def _tensor_of(owner: nn.Module, name: str):
    """``owner``'s buffer or parameter ``name`` as it is now (None if it has neither)."""
    return owner._buffers[name] if name in owner._buffers else owner._parameters.get(name)
