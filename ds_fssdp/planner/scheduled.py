"""A layer priced as the exchange that runs it: what every by-time decision compares plans with.

Legend: D ranks, G ranks per node.

FSSDP's by-time decisions (t, :mod:`ds_fssdp.planner.overlap`; calibration's candidates; the
``balanced-time`` dispatch) compare plans by ``CostModel.layer_time``. Under the layer schedule
(issue 24: the exchange pipelined with the expert compute at chosen degrees, one copy per
destination, two hops across nodes) a plan's layer costs what
:func:`~ds_fssdp.planner.onecopy.price_exchange` says, not the serial four exchanges and compute
of :meth:`CostModel.layer_time`.

* :class:`ExchangeOptions`: how a layer's exchange runs (top-k, row and gate-weight bytes, one
  copy per destination on, off or "auto", fixed or chosen degrees, two hops across nodes) and
  :meth:`ExchangeOptions.price`, the one call that prices it.
* :class:`ScheduledCostModel`: a :class:`~ds_fssdp.planner.cost.CostModel` whose
  :meth:`~ScheduledCostModel.layer_time` is that price's forward + backward.

The runtime builds it from its configuration, on the schedule's costs its degrees are chosen
from (fitted at initialize and refitted, or ``fssdp.hardware``'s; without them, its agreed
hardware's), the report's replay from the trace's record of both (the exchange options in the
sidecar, the costs per decision), and the simulator from its options and modelled hardware
(``sim/pipeline.py``'s ``LayerSchedule`` prices every simulated layer through the same
:meth:`ExchangeOptions.price`), so the same plans get the same price everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware, schedule_costs
from ds_fssdp.planner.onecopy import ExchangePrice, choose_exchange, price_exchange
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.schedule import ScheduleCosts, link_busy
from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class ExchangeOptions:
    """How a layer's token exchange runs."""

    top_k: int
    token_bytes: float  # bytes of one row (hidden x the activations' element size)
    weight_bytes: float  # bytes of one gate weight (one copy per destination sends them)
    one_copy: bool | str = True  # one copy per destination: True, False or "auto" (priced both ways)
    degrees: tuple | None = None  # fixed (forward, backward) pipeline degrees; None: chosen per layer
    two_hops: bool = True  # one copy crosses nodes once per node and is forwarded inside (topology_aware)
    # work beside the exchange per token, in expert rows (shared experts overlapped with a chunked
    # exchange; onecopy.side_rows); 0: none
    side_ratio: float = 0.0

    def __post_init__(self):
        if self.one_copy not in (True, False, "auto"):
            raise ValueError(f"one_copy ({self.one_copy!r}) must be True, False or \"auto\"")
        if self.degrees is not None:
            d = tuple(self.degrees)
            if len(d) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in d):
                raise ValueError(f"degrees ({self.degrees!r}) must be None or two ints >= 1")
        if not self.side_ratio >= 0:
            raise ValueError(f"side_ratio ({self.side_ratio!r}) must be >= 0")

    @classmethod
    def of(cls, shape: ExpertShape, *, top_k: int, one_copy, pipeline_degree, two_hops: bool,
           side_ratio: float = 0.0) -> "ExchangeOptions":
        """From the ``"fssdp"`` settings' values (``pipeline_degree``: "auto" or a (forward,
        backward) pair), rows and gate weights in the experts' dtype: what the runtime, the replay
        and the simulators build their options with."""
        return cls(top_k=int(top_k), token_bytes=float(shape.token_bytes), weight_bytes=float(shape.param_bytes),
                   one_copy=one_copy,
                   degrees=None if pipeline_degree == "auto" else tuple(int(v) for v in pipeline_degree),
                   two_hops=bool(two_hops), side_ratio=float(side_ratio))

    def price(self, costs: ScheduleCosts, traffic_DD, *, ranks_per_node: int) -> ExchangePrice:
        """The exchange of ``traffic_DD`` (rows rank d sends rank h, diagonal its own) as it runs:
        :func:`price_exchange` with these options. Top-1 never takes one copy (nothing to share);
        two hops only with several nodes of several ranks."""
        traffic = np.asarray(traffic_DD, dtype=np.float64)
        D, G = traffic.shape[0], int(ranks_per_node)
        return price_exchange(costs, traffic, ranks_per_node=G, token_bytes=float(self.token_bytes),
                              top_k=self.top_k, weight_bytes=float(self.weight_bytes),
                              one_copy=one_copy_at(self.one_copy, self.top_k),
                              relay=self.two_hops and 1 < G < D, degrees=self.degrees, side_ratio=self.side_ratio)


class ScheduledCostModel(CostModel):
    """:class:`CostModel` with :meth:`layer_time` priced by the schedule that runs the layer
    (module docstring). ``costs``: the schedule's costs, or a function returning its owner's current
    ones (the runtime's fitted or configured costs, the replay's recorded ones: one link model,
    read where it is kept, never set from outside); None (or a function returning None): the
    hardware's, :func:`~ds_fssdp.planner.cost.schedule_costs`. ``exchange``: the options, or a
    function returning them (built with the two hops of the planner inputs the model is one of,
    ``planner/inputs.py``: read when a plan is priced, after the factory ran)."""

    def __init__(self, hw: Hardware, shape: ExpertShape, topology: Topology, *, exchange,
                 relay: bool = False, costs=None):
        super().__init__(hw, shape, topology, relay=relay)
        self._exchange = exchange
        self._hardware_costs = schedule_costs(hw, shape)
        self._costs = costs

    @property
    def exchange(self) -> ExchangeOptions:
        return self._exchange() if callable(self._exchange) else self._exchange

    @property
    def costs(self) -> ScheduleCosts:
        c = self._costs() if callable(self._costs) else self._costs
        return self._hardware_costs if c is None else c

    def price(self, plan) -> ExchangePrice:
        """The exchange of ``plan`` (a compact :class:`DispatchPlan` or a dense ``plan_EDD``)."""
        traffic_DD = plan.traffic_rows_DD() if isinstance(plan, DispatchPlan) else plan.sum(0)
        traffic = traffic_DD.to(torch.float64).numpy() if isinstance(traffic_DD, torch.Tensor) else traffic_DD
        return self.exchange.price(self.costs, traffic, ranks_per_node=self.topology.ranks_per_node)

    def layer_time(self, plan) -> float:
        """Forward + backward of the layer's exchange and expert compute, the slowest rank's in
        each direction, as :meth:`price` runs it."""
        return self.layer_price(plan)[0]

    def layer_price(self, plan, attention_s: float | None = None) -> tuple:
        """``(layer_time(plan), reduce_window_s(...))`` from one :meth:`price` (the window None
        without ``attention_s``)."""
        p = self.price(plan)
        layer_s = float(p.forward_R.max() + p.backward_R.max())
        return layer_s, (None if attention_s is None else
                         reduce_window_s(self.costs, p, attention_s, across_nodes=self.topology.num_nodes > 1))


def reduce_window_s(costs: ScheduleCosts, price: ExchangePrice, attention_s: float, *, across_nodes: bool) -> float:
    """Seconds that hide a layer's replica reduce: its attention backward (twice the forward's
    ``attention_s``) plus the time its backward exchange (``price``) leaves the reduce's link free:
    the node link when the group spans nodes (``across_nodes``), else the rank's. What both
    simulators charge the reduce against, and what the search by time prices it with."""
    busy = link_busy(costs, price.link_load, price.degrees[1])[1 if across_nodes else 0]
    idle = float(price.backward_R.max()) - busy
    return 2.0 * attention_s + (idle if idle > 0.0 else 0.0)


def one_copy_at(one_copy, top_k: int):
    """The one-copy setting a layer of ``top_k`` runs: off at top-1 (a token has one row, nothing to
    share), else as configured (True, False or "auto"). The runtime's decision
    (:func:`exchange_decision`) and its price (:meth:`ExchangeOptions.price`) both take it here."""
    return one_copy if one_copy and int(top_k) > 1 else False


def exchange_decision(costs: ScheduleCosts | None, traffic_DD, *, pipeline_degree, one_copy, ranks_per_node: int,
                      token_bytes: float, top_k: int, weight_bytes: float, two_hops: bool,
                      side_ratio: float = 0.0) -> tuple:
    """A layer's exchange this iteration, as the runtime takes it and the replay retakes it:
    ``((forward, backward) pipeline degrees, one copy per destination)``. The configured ones
    where fixed (``pipeline_degree``: "auto" or a pair; ``one_copy``: True, False or "auto"); what
    is "auto", :func:`~ds_fssdp.planner.onecopy.choose_exchange` on ``costs`` and the plan's
    traffic (``traffic_DD``, or a callable computing it only when needed), two hops where they run.
    ``side_ratio``: the layer's work beside the exchange per token in expert rows (its shared
    experts; :func:`~ds_fssdp.planner.onecopy.side_rows`). Without costs: degree 1 (or the fixed
    degrees) and one copy on unless configured off. Top-1: one copy off (:func:`one_copy_at`)."""
    fixed = None if pipeline_degree == "auto" else (int(pipeline_degree[0]), int(pipeline_degree[1]))
    one_copy = one_copy_at(one_copy, top_k)
    if costs is None or (fixed is not None and one_copy != "auto"):
        return (fixed or (1, 1)), (True if one_copy == "auto" else bool(one_copy))
    traffic = np.asarray(traffic_DD() if callable(traffic_DD) else traffic_DD)
    G, D = int(ranks_per_node), traffic.shape[0]
    return choose_exchange(costs, traffic, ranks_per_node=G, token_bytes=token_bytes, top_k=top_k,
                           weight_bytes=weight_bytes, one_copy=one_copy, degrees=fixed, relay=two_hops and 1 < G < D,
                           side_ratio=side_ratio)
