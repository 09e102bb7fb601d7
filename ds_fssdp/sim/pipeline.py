"""The layer schedule in the simulators (issue 24): both engines price a layer's exchange and
expert compute through :mod:`ds_fssdp.planner.schedule` (the runtime's decision functions), with
costs from the modelled hardware (:func:`ds_fssdp.planner.cost.schedule_costs`).

Legend: B groups, N ranks of a group, d source rank, h destination rank.

Per layer and group, from the rows each rank sends each rank (``traffic_BNN``, the diagonal a
rank's own tokens on experts it holds):

* one copy per destination (``dedup``: on, off, or ``"auto"``: per layer and group where
  :func:`~ds_fssdp.planner.onecopy.choose_exchange`, the runtime's function, says it pays): the
  bytes d sends h shrink by :func:`~ds_fssdp.planner.onecopy.distinct_fraction` (k independent
  picks per token: an approximation, count traces carry no per-token picks), the rows computed do
  not, and the layer pays :func:`~ds_fssdp.planner.onecopy.one_copy_overhead_s` (the count
  all-gather, the routing entries, the gate weights); with several nodes of several ranks it runs
  as the runtime's two hops (``topology_aware``, its default; priced by ``pipeline_times``:
  around the exchange at degree 1, both hops chunked above it, :func:`~ds_fssdp.planner.onecopy.relay_loads`),
  its link bytes (reported, and the bytes saved) :func:`~ds_fssdp.planner.onecopy.relay_traffic`'s;
* the work beside the exchange (``side_ratio``: the shared experts per token in expert rows,
  ``Setup.side_ratio``): every rank's ``side_rows`` (:func:`~ds_fssdp.planner.onecopy.side_rows`),
  in sequence at degree 1 (every serial policy), above it once the last return is launched;
* one :class:`~ds_fssdp.planner.schedule.LayerLoad` per rank, from the group's traffic by the
  runtime's function (:func:`~ds_fssdp.planner.schedule.loads_from_traffic`): the rank's intra-node
  link bytes (busier direction), its node's inter-node link bytes, its own local rows (computed
  first) and remote rows;
* degrees: :func:`~ds_fssdp.planner.onecopy.choose_exchange` with the one copy decision, over the
  loads of the exchange that runs (or the fixed ``pipeline_degree``); forward and backward:
  :func:`~ds_fssdp.planner.schedule.pipeline_time`,
  the slowest rank's; the links' busy seconds: :func:`~ds_fssdp.planner.schedule.link_busy`.

Replicas on the idle link: layer l + 1's gather may start during layer l's expert compute, so
its window is l + 1's attention forward plus the time l's forward leaves the gather's link class
(inter-node when the group spans nodes, else intra-node) free; t comes from that window through
:meth:`~ds_fssdp.planner.cost.CostModel.overlap_degree` (the last step's window: a decision is
taken before the layer runs). Two layers' replicas are then alive at once; the memory already
counts them (every layer's without re-materialization, the largest two consecutive layers'
with it), so m and the memory cap hold unchanged. The replica reduce gets the attention
backward plus the time the backward leaves that link free.

At degree 1 without dedup this is the serial accounting the simulators had (4 exchanges + the
slowest rank's compute; tested). ``ep``, ``uniform`` and the paper's other published baselines
keep it (:func:`policy_options`); ``fsmoe`` is EP with FSMoE's schedule (degrees chosen, gradients
in the gaps, no replicas, no dedup).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ds_fssdp.planner.cost import Hardware, schedule_costs
from ds_fssdp.planner.scheduled import ExchangeOptions, reduce_window_s
from ds_fssdp.planner.schedule import MAX_DEGREE, link_busy
from ds_fssdp.sim.links import Links, traffic_links

INTRA, INTER = 0, 1  # link classes (columns of the busy arrays)


@dataclass(frozen=True)
class ScheduleOptions:
    """How the simulator schedules FSSDP's layers (``--pipeline-degree``, ``--no-dedup``,
    ``--no-grad-gaps``, ``--no-idle-link``)."""

    pipeline_degree: int | None = None  # None: chosen per layer (choose_degrees); n: both directions
    dedup: bool | str = True  # one copy per destination: on (the runtime's default), off, or "auto": per layer
    # where it pays (choose_one_copy)
    grad_gaps: bool = True  # EDP + dense all-reduce in the backward's link gaps
    idle_link: bool = True  # replica gather from the previous layer's expert compute on
    price_by_schedule: bool = True  # calibration / balanced-time price plans by the schedule's layer time
    t_by_time: bool = True  # with the idle link: t searched by the modelled layer time from the window's t up
    # (planner/overlap.py), not only what the window hides

    def __post_init__(self):
        if self.dedup not in (True, False, "auto"):
            raise ValueError(f"dedup ({self.dedup!r}) must be True, False or \"auto\"")
        d = self.pipeline_degree
        if d is not None and not (isinstance(d, int) and 1 <= d <= MAX_DEGREE):
            raise ValueError(f"pipeline_degree ({d!r}) must be None (auto) or an int in [1, {MAX_DEGREE}]")


SERIAL = ScheduleOptions(pipeline_degree=1, dedup=False, grad_gaps=False, idle_link=False, price_by_schedule=False,
                         t_by_time=False)
SCHEDULED = ("fsmoe", "fssdp", "fssdp-rm")  # policies that run the schedule


def policy_options(name: str, options: ScheduleOptions | None) -> ScheduleOptions:
    """The schedule a policy runs: FSSDP's the given ``options`` (default: everything on),
    ``fsmoe`` FSMoE's (the same degree option; no dedup, no replicas), the rest serial."""
    options = ScheduleOptions() if options is None else options
    if name == "fsmoe":
        return replace(options, dedup=False, idle_link=False, price_by_schedule=False, t_by_time=False)
    return options if name in SCHEDULED else SERIAL


@dataclass
class LayerTimes:
    """One layer of B groups under the schedule."""

    links: Links  # the exchange's bytes (after dedup) and rows computed
    moe_B: np.ndarray  # forward + backward expert compute of the slowest rank
    side_B: np.ndarray  # forward + backward work beside the exchange (shared experts), the most of a rank's
    forward_B: np.ndarray  # exchange + expert compute + exchange back, slowest rank
    backward_B: np.ndarray
    degrees: list  # (forward, backward) per group
    busy_forward_B2: np.ndarray  # seconds the [intra, inter] links carry the exchange
    busy_backward_B2: np.ndarray
    # link bytes (GPU + node links, all groups) one exchange saves by dedup: negative where the relays'
    # forwarding inside nodes moves more than the copies save (as the runtime's ``a2a_bytes_saved``)
    saved_bytes: float = 0.0
    one_copy: list = field(default_factory=list)  # per group: one copy per destination taken
    prices: list = field(default_factory=list)  # per group: the ExchangePrice the layer ran at


class LayerSchedule:
    """Prices a layer for one engine: hardware, ranks per node, token bytes, top-k, options."""

    def __init__(self, hw: Hardware, shape, *, ranks_per_node: int, top_k: int, options: ScheduleOptions,
                 two_hops=True, side_ratio: float = 0.0):
        """``two_hops``: a function returning the planner inputs' (``PlannerInputs.two_hops``, the
        runtime's ``topology_aware``: what both engines pass), read at the first layer priced
        (after the factory ran); or a value (a schedule priced on its own)."""
        self.hw, self.shape, self.G, self.top_k, self.options = hw, shape, ranks_per_node, top_k, options
        self.costs = schedule_costs(hw, shape)
        self._two_hops, self._exchange, self._side_ratio = two_hops, None, side_ratio

    @property
    def exchange(self) -> ExchangeOptions:
        if self._exchange is None:
            d = self.options.pipeline_degree
            self._exchange = ExchangeOptions.of(self.shape, top_k=self.top_k, one_copy=self.options.dedup,
                                                pipeline_degree="auto" if d is None else (d, d),
                                                two_hops=hops() if callable(hops := self._two_hops) else hops,
                                                side_ratio=self._side_ratio)
        return self._exchange

    def layer(self, traffic_BNN: np.ndarray) -> LayerTimes:
        row_bytes = float(self.shape.token_bytes)
        plain = traffic_links(traffic_BNN, ranks_per_node=self.G, row_bytes=row_bytes)
        B = traffic_BNN.shape[0]
        fwd, bwd = np.zeros(B), np.zeros(B)
        busy_f, busy_b = np.zeros((B, 2)), np.zeros((B, 2))
        sent_BNN, routed, prices = traffic_BNN.copy(), {}, []
        for b in range(B):
            # The decisions, as the runtime takes them (onecopy.choose_exchange's price_exchange on the
            # plan's traffic, through the by-time decisions' one pricing call); the time, from what crosses
            # (one copy per destination sends fewer rows than it computes, and its routing entries and gate
            # weights besides).
            price = self.exchange.price(self.costs, traffic_BNN[b], ranks_per_node=self.G)
            prices.append(price)
            if price.one_copy:
                sent_BNN[b] = price.sent_DD
                if price.routed is not None:
                    routed[b] = price.routed
            fwd[b], bwd[b] = price.forward_R.max(), price.backward_R.max()
            # Every rank's load carries the group's busiest links (loads_from_traffic): one is enough.
            busy_f[b], busy_b[b] = (link_busy(self.costs, price.link_load, d) for d in price.degrees)
        links = traffic_links(sent_BNN, ranks_per_node=self.G, row_bytes=row_bytes, rows_BNN=traffic_BNN)
        if routed:  # one copy per destination over two hops: the routed bytes in place of one hop's
            idx = list(routed)
            links.inter_total -= traffic_links(sent_BNN[idx], ranks_per_node=self.G, row_bytes=row_bytes).inter_total
            for b, (rank_N, node_n, crossing, _) in routed.items():
                links.inter_total += crossing * row_bytes
                links.rank_BN[b], links.node_Bn[b] = rank_N * row_bytes, node_n * row_bytes
        moe_B = links.rows_BN.max(1) * (3.0 * self.shape.row_flops / self.hw.flops)
        side_B = np.array([p.load_cols[:, 4].max() for p in prices]) * (3.0 * self.shape.row_flops /
                                                                                     self.hw.flops)
        return LayerTimes(links=links, moe_B=moe_B, side_B=side_B, forward_B=fwd, backward_B=bwd,
                          degrees=[p.degrees for p in prices], busy_forward_B2=busy_f, busy_backward_B2=busy_b,
                          saved_bytes=float(plain.rank_BN.sum() + plain.node_Bn.sum() - links.rank_BN.sum()
                                            - links.node_Bn.sum()), one_copy=[p.one_copy for p in prices],
                          prices=prices)

    def reduce_windows(self, lt: LayerTimes, attention_s: float, *, across_nodes: bool) -> np.ndarray:
        """Per group, the seconds that hide the layer's replica reduce: the planner's
        :func:`~ds_fssdp.planner.scheduled.reduce_window_s` of the exchange it ran (what the search
        by time prices the reduce with)."""
        return np.array([reduce_window_s(self.costs, p, attention_s, across_nodes=across_nodes) for p in lt.prices])


def binding_class(links: Links, hw: Hardware) -> int:
    """The link class a collective's time is bound by (:data:`INTRA` or :data:`INTER`)."""
    intra = float(links.rank_BN.max()) / hw.intra_bw
    inter = float(links.node_Bn.max()) / hw.inter_bw if links.node_Bn.size else 0.0
    return INTER if inter > intra else INTRA
