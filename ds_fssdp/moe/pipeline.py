"""One layer's token exchange split into ragged chunks that pipeline with the expert compute
(FSMoE, seed 002; the modelled schedule is ``planner/schedule.py``'s docstring), forward degree f
and backward degree b independent: one autograd Function (:class:`PipelinedExperts`) over the
exchange + expert compute + exchange back, its chunks cut by :class:`ChunkPlan` (two hops across
nodes: ``moe/relay.py``'s ``RelayPlan``). The cuts, the atoms, the local rows first, the order
(D1 D2 C1 D3 C2 ... Cn), the autograd, one copy per destination and the work beside the exchange
as run here: docs/design.md section 4, "Chunked exchange". Degree (1, 1) is not this module: the
layer runs ``compute.dispatch_compute_combine`` (or its ``_dedup`` form) unchanged.

Legend: T tokens, K top-k, H hidden, R rows received, S local compute slots, D ranks, P elements
per expert, f / b the forward / backward degrees.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from fractions import Fraction
from typing import Mapping, Optional, Sequence

import torch
from deepspeed import comm as dist

from ds_fssdp import ops
from ds_fssdp.moe.compute import combine_received, expand_received, hop_buffers
from ds_fssdp.ops.lora import LoraFactors


@dataclasses.dataclass(frozen=True)
class ExchangeGroups:
    """The token exchange's communicators (built by ``runtime/groups.py``; passed in).

    ``intra``: this rank's node inside its FSSDP group (group ranks ``node * G .. node * G + G - 1``,
    in that order); with one node, all of the FSSDP group's ranks. ``inter``: all of the FSSDP
    group's ranks, for the cross-node pairs (None: one node)."""
    intra: object
    inter: object | None
    ranks_per_node: int


def atom_cuts(forward: int, backward: int) -> list:
    """The sorted union of {i / forward} and {j / backward} (Fractions, 0 and 1 included)."""
    if forward < 1 or backward < 1:
        raise ValueError(f"pipeline degrees ({forward}, {backward}) must be >= 1")
    return sorted({Fraction(i, forward) for i in range(forward + 1)} | {Fraction(j, backward)
                                                                       for j in range(backward + 1)})


def cut(n: int, q: Fraction) -> int:
    """floor(n * q): where a pair of n rows is cut at fraction q."""
    return n * q.numerator // q.denominator


def atom_of_rows(splits: list, cuts: list) -> torch.Tensor:
    """The atom of every row of consecutive blocks of ``splits`` rows (long [sum], host): row j of
    a block of n rows is in atom a where ``cut(n, cuts[a]) <= j < cut(n, cuts[a + 1])``."""
    m_D = torch.tensor([int(n) for n in splits], dtype=torch.long)
    num = torch.tensor([q.numerator for q in cuts[1:]], dtype=torch.long)
    den = torch.tensor([q.denominator for q in cuts[1:]], dtype=torch.long)
    cuts_DA = torch.div(m_D[:, None] * num[None, :], den[None, :], rounding_mode="floor")  # [D, A]
    src_R = torch.repeat_interleave(torch.arange(len(m_D)), m_D)
    j_R = torch.arange(src_R.numel()) - (torch.cumsum(m_D, 0) - m_D)[src_R]
    return torch.searchsorted(cuts_DA[src_R], j_R[:, None], right=True).squeeze(1)


def block_ranges(splits: list, off: list, rank: int, q0: Fraction, q1: Fraction) -> list:
    """Rows ``[lo, hi)`` of each peer's block (``splits`` rows at ``off``) between fractions q0 and
    q1 (None for ``rank``: its own block is handled whole)."""
    return [None if d == rank else (o + cut(n, q0), o + cut(n, q1)) for d, (o, n) in enumerate(zip(off, splits))]


class Cuts:
    """The atoms of degrees ``(forward, backward)`` and their chunks (this rank's view)."""

    def __init__(self, rank: int, degrees: tuple):
        self.rank, self.degrees = rank, tuple(int(d) for d in degrees)
        self.cuts = atom_cuts(*self.degrees)

    def chunk(self, degree: int, i: int) -> tuple:
        """Chunk i (0-based) of ``degree``: its fractions (q0, q1) and its atoms."""
        q0, q1 = Fraction(i, degree), Fraction(i + 1, degree)
        return q0, q1, [a for a in range(len(self.cuts) - 1) if self.cuts[a] >= q0 and self.cuts[a + 1] <= q1]


class ChunkPlan(Cuts):
    """The cuts of one dispatch (this rank's view), computed once per forward on the host.

    ``units[a]`` for atom a (and ``units[-1]`` for the local rows): the compute-order positions'
    receive rows (long [n]), its rows per local slot (list [S]) and None; with ``expand``: its
    received rows (long [u]), its rows per local slot and its ``(token_c, rows_uk)`` tables
    (:func:`_expanded_units`)."""

    def __init__(self, *, rank: int, degrees: tuple, send_splits: list, recv_splits: list,
                 group_perm: torch.Tensor | None, group_sizes: list, device=None, expand: tuple | None = None):
        """``device``: where the receive positions live (the rows' device; one copy each).
        ``expand``: one copy per destination's receiver tables ``(rows_UK, token_C)``
        (``moe/dedup.py``; the splits are then the unique rows'): each unit's received rows expand
        to their compute rows (``group_perm`` unused)."""
        super().__init__(rank, degrees)
        self.send_splits, self.recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
        self.send_off = _offsets(self.send_splits)
        self.recv_off = _offsets(self.recv_splits)
        A, S = len(self.cuts) - 1, len(group_sizes)
        # Unit of every received row: its atom, A for the local rows (source == this rank).
        unit_R = atom_of_rows(self.recv_splits, self.cuts)
        lo, hi = self.local("recv")
        unit_R[lo:hi] = A
        slot_C = torch.repeat_interleave(torch.arange(S), torch.tensor(group_sizes, dtype=torch.long))
        if expand is not None:
            self.units = _expanded_units(unit_R, slot_C, *expand, A=A, S=S, device=device)
            return
        perm_C = group_perm.to("cpu", torch.long)
        unit_C = unit_R[perm_C]
        order = torch.sort(unit_C, stable=True).indices  # compute order kept inside a unit
        counts = torch.bincount(unit_C, minlength=A + 1).tolist()
        self.units = [(perm_C[pos].to(device), torch.bincount(slot_C[pos], minlength=S).tolist(), None)
                      for pos in torch.split(order, counts)]

    def ranges(self, side: str, q0: Fraction, q1: Fraction) -> list:
        """:func:`block_ranges` in the send buffer (``side`` "send") or the receive buffer ("recv")."""
        splits, off = (self.send_splits, self.send_off) if side == "send" else (self.recv_splits, self.recv_off)
        return block_ranges(splits, off, self.rank, q0, q1)

    def local(self, side: str) -> tuple:
        """This rank's own block ``[lo, hi)`` in the send or receive buffer."""
        splits, off = (self.send_splits, self.send_off) if side == "send" else (self.recv_splits, self.recv_off)
        return off[self.rank], off[self.rank] + splits[self.rank]

    def run(self, degree: int, groups: ExchangeGroups, world: int, src_RH: torch.Tensor, recv_RH: torch.Tensor,
            back_recv_RH: torch.Tensor, back_sent_RH: torch.Tensor, work, after=None) -> None:
        """One direction of the chunked schedule, in ``planner/schedule.py``'s order: chunk 1 of
        ``src_RH`` (send order) is launched, this rank's own rows are copied into ``recv_RH`` (receive
        order) and worked on while it flies; then per chunk i: launch chunk i + 1, land chunk i, ``work``
        its atoms (``work(units)`` fills ``back_recv_RH`` at their rows), send their results back into
        ``back_sent_RH`` (send order); ``after()`` (the work beside the exchange) once the last return
        is launched; every return landed at the end. The forward sends rows and
        returns outputs; the backward sends output gradients and returns input gradients."""
        rank = self.rank
        q0, q1, _ = self.chunk(degree, 0)
        pending = start_exchange(groups, rank, world, src_RH, self.ranges("send", q0, q1), self.ranges("recv", q0, q1))
        (slo, shi), (rlo, rhi) = self.local("send"), self.local("recv")
        recv_RH[rlo:rhi].copy_(src_RH[slo:shi])
        work([len(self.units) - 1])  # the local rows, while chunk 1 is in flight
        back_sent_RH[slo:shi].copy_(back_recv_RH[rlo:rhi])
        returns = []
        for i in range(degree):
            q0, q1, atoms = self.chunk(degree, i)
            nxt = None
            if i + 1 < degree:
                n0, n1, _ = self.chunk(degree, i + 1)
                nxt = start_exchange(groups, rank, world, src_RH, self.ranges("send", n0, n1),
                                     self.ranges("recv", n0, n1))
            pending.land(recv_RH)
            work(atoms)
            returns.append(start_exchange(groups, rank, world, back_recv_RH, self.ranges("recv", q0, q1),
                                          self.ranges("send", q0, q1)))
            pending = nxt
        if after is not None:
            after()
        for r in returns:
            r.land(back_sent_RH)


def _expanded_units(unit_U: torch.Tensor, slot_C: torch.Tensor, rows_UK: torch.Tensor, token_C: torch.Tensor, *,
                    A: int, S: int, device) -> list:
    """Per unit (atoms, then the local rows): its received rows (ascending), its rows per local
    slot, and its own ``expand_received`` tables ``(token_c, rows_uk)`` over those rows and its
    compute rows (compute order kept: a compute row belongs to the unit of the row it expands from)."""
    rows_UK, token_C = rows_UK.to("cpu", torch.long), token_C.to("cpu", torch.long)
    unit_C = unit_U[token_C]
    local_U = torch.full((unit_U.numel(), ), -1, dtype=torch.long)
    local_C = torch.full((unit_C.numel(), ), -1, dtype=torch.long)
    units = []
    for a in range(A + 1):
        u = torch.nonzero(unit_U == a).flatten()
        c = torch.nonzero(unit_C == a).flatten()
        local_U[u] = torch.arange(u.numel())
        local_C[c] = torch.arange(c.numel())
        rows_uk = rows_UK[u]
        rows_uk = torch.where(rows_uk >= 0, local_C[rows_uk.clamp(min=0)], -1) if c.numel() else rows_uk.clone()
        units.append((u.to(device), torch.bincount(slot_C[c], minlength=S).tolist(),
                      (local_U[token_C[c]].to(device), rows_uk.to(device))))
    return units


def _offsets(splits: list) -> list:
    return list(itertools.accumulate(splits, initial=0))[:-1]


class _Pending:
    """An exchange in flight: its parts' works and receive buffers, landed into ``dst``."""

    def __init__(self, parts: list):
        self.parts = parts  # (work, recv, [(dst lo, dst hi)] in recv order)

    def land(self, dst: torch.Tensor) -> None:
        for work, recv, spans in self.parts:
            work.wait()
            at = 0
            for lo, hi in spans:
                if hi > lo:
                    dst[lo:hi].copy_(recv[at:at + hi - lo])
                    at += hi - lo


def start_exchange(groups: ExchangeGroups, rank: int, world: int, src: torch.Tensor, src_ranges: list,
                   dst_ranges: list, *, links: tuple = ("intra", "inter")) -> _Pending:
    """Send ``src[src_ranges[d]]`` to every peer d, receive ``dst_ranges[d]``'s rows from it
    (asynchronous, through deepspeed.comm): one all-to-all per link class of ``links``, every rank
    joins each (a class left out must carry nothing)."""
    G = groups.ranks_per_node if groups.inter is not None else world
    node = rank // G
    parts = []
    link_peers = []
    if "intra" in links or groups.inter is None:  # one group: it carries every link class
        link_peers.append((groups.intra, list(range(node * G, node * G + G)), lambda d: True))
    if groups.inter is not None and "inter" in links:
        link_peers.append((groups.inter, list(range(world)), lambda d: d // G != node))
    empty = (0, 0)
    for group, peers, remote in link_peers:
        srcs = [(src_ranges[d] if src_ranges[d] is not None and remote(d) else empty) for d in peers]
        dsts = [(dst_ranges[d] if dst_ranges[d] is not None and remote(d) else empty) for d in peers]
        in_splits = [hi - lo for lo, hi in srcs]
        out_splits = [hi - lo for lo, hi in dsts]
        pieces = [src[lo:hi] for lo, hi in srcs if hi > lo]
        send = torch.cat(pieces) if pieces else src.new_empty((0, ) + tuple(src.shape[1:]))
        recv = src.new_empty((sum(out_splits), ) + tuple(src.shape[1:]))
        work = dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, group=group, async_op=True)
        parts.append((work, recv, dsts))
    return _Pending(parts)


@dataclasses.dataclass
class PipelineExperts:
    """The expert computation of one forward: the weights autograd sees as inputs and how to
    build the expert function from their leaves.

    ``rows``: owned rows [S0, P]; ``replica``: replica rows [R, P] (an autograd input), or, under
    re-materialization (``source`` set), the forward's replicas (not an input: the backward gets
    them again from ``source.rematerialized()`` and gives their gradient to
    ``source.replica_grad_ready``); ``lora``: LoRA factors by weight name (``ops.expert_mlp``)."""
    spec: object  # ExpertSpec
    rows: torch.Tensor
    replica: torch.Tensor
    lora: Optional[Mapping[str, Sequence[LoraFactors]]] = None
    source: object | None = None  # the replica manager under re-materialization

    @property
    def remat(self) -> bool:
        return self.source is not None

    def inputs(self) -> list:
        """The tensors the Function takes (and returns gradients for), in order."""
        out = [self.rows] + ([] if self.remat else [self.replica])
        for name in sorted(self.lora or {}):
            for f in self.lora[name]:
                out += [f.a_GIr, f.b_GrO]
        return out

    def build(self, tensors: list, replica: torch.Tensor | None = None) -> tuple:
        """(expert_fn, weight views by name, LoRA leaves) over ``tensors`` (leaves, in
        :meth:`inputs`' order); ``replica``: the replica rows under re-materialization."""
        rows = tensors[0]
        k = 1
        if not self.remat:
            replica, k = tensors[1], 2
        lora, leaves = {}, []
        for name in sorted(self.lora or {}):
            fs = []
            for f in self.lora[name]:
                a, b = tensors[k], tensors[k + 1]
                k += 2
                leaves += [a, b]
                fs.append(LoraFactors(a, b, f.scaling))
            lora[name] = fs
        weights = self.spec.views(torch.cat([rows, replica]))
        fn = functools.partial(ops.expert_mlp, activation=self.spec.activation, act_params=self.spec.act_params,
                               lora=lora or None)
        return (lambda x_RH, sizes: fn(x_RH, weights, sizes)), weights, leaves


def _unit_fn(fn, x, w, sizes: list, tables) -> torch.Tensor:
    """One unit's expert compute: rows -> rows, or with one copy per destination (``tables``)
    received rows -> expanded compute rows -> one gate-weighted row per received row."""
    if tables is None:
        return fn(x, sizes)
    token_c, rows_uk = tables
    return combine_received(fn(expand_received(x, token_c, rows_uk), sizes), rows_uk, w)




class PipelinedExperts(torch.autograd.Function):
    """send_RH (send order) -> y_sent_RH (send order): dispatch, expert compute, combine in chunks.

    The exchanged unit is a chunk of each (source, destination) pair's rows cut by
    :class:`ChunkPlan`; the received rows are grouped per atom through ``plan.units``. With one
    copy per destination (the plan's ``expand``), ``w_recv_UK`` holds the received rows' gate
    weights (receive order, an autograd input): each unit expands its received rows to its compute
    rows (``compute.expand_received``), runs the grouped GEMM and combines its outputs into one row
    per received row (``compute.combine_received``) before the unit's combine exchange; otherwise
    ``w_recv_UK`` is None and each compute row returns as it is."""

    @staticmethod
    def forward(ctx, send_RH, w_recv_UK, plan: ChunkPlan, experts: PipelineExperts, groups: ExchangeGroups,
                world: int, record: bool, side, side_x, *tensors):
        f, _ = plan.degrees
        H = send_RH.shape[1:]
        x_recv = send_RH.new_empty((sum(plan.recv_splits), ) + tuple(H))
        y_recv = torch.empty_like(x_recv)
        y_sent = torch.empty_like(send_RH)
        keep = record and not experts.remat  # the forward's graphs serve the backward
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        replica = experts.replica.detach() if experts.remat else None
        graphs = {}

        def compute(u: int) -> None:
            pos, sizes, tables = plan.units[u]
            if pos.numel() == 0:
                return
            x = x_recv.index_select(0, pos)
            w = None if w_recv_UK is None else w_recv_UK.detach().index_select(0, pos)
            if keep:
                x.requires_grad_(True)
                w = None if w is None else w.requires_grad_(True)
                with torch.enable_grad():
                    y = _unit_fn(fn, x, w, sizes, tables)
                graphs[u] = (x, w, y)
            else:
                y = _unit_fn(fn, x, w, sizes, tables)
            y_recv.index_copy_(0, pos, y.detach())

        side_out = []

        def side_work() -> None:  # the work beside the exchange, with its own graph when a backward may follow
            fn, grad = side
            leaf = side_x.detach().requires_grad_(side_x.requires_grad)
            with torch.set_grad_enabled(grad):
                side_out.extend([leaf, fn(leaf)])

        # Identity hooks: this Function's own graphs keep their tensors (an enclosing checkpoint's
        # hooks would otherwise replace them; its recompute replays the whole Function instead).
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.set_grad_enabled(keep):
            fn, weights, lora_leaves = experts.build(leaves, replica)
            plan.run(f, groups, world, send_RH, x_recv, y_recv, y_sent,
                     lambda units: [compute(u) for u in units], after=None if side is None else side_work)
        # Under RM nothing here may keep the replicas alive until the backward (the weights' views
        # hold a copy of them, ``experts.replica`` is the forward's buffer).
        ctx.plan, ctx.groups, ctx.world = plan, groups, world
        ctx.experts = dataclasses.replace(experts, replica=None) if experts.remat else experts
        ctx.graphs, ctx.weights, ctx.lora_leaves, ctx.leaves = graphs, (weights if keep else None), lora_leaves, leaves
        ctx.x_recv = None if keep else x_recv  # re-materialization recomputes from the inputs
        ctx.w_recv = None if keep or w_recv_UK is None else w_recv_UK.detach()
        ctx.has_w, ctx.needs_w = w_recv_UK is not None, w_recv_UK is not None and w_recv_UK.requires_grad
        ctx.w_meta = None if w_recv_UK is None else (w_recv_UK.shape, w_recv_UK.dtype)
        ctx.needs = [t.requires_grad for t in tensors]
        ctx.side = tuple(side_out) if side_out and side_out[1].requires_grad else None
        return y_sent if side is None else (y_sent, side_out[1].detach())

    @staticmethod
    def backward(ctx, dy_sent, dside=None):
        plan, experts, groups, world = ctx.plan, ctx.experts, ctx.groups, ctx.world
        _, b = plan.degrees
        dy_sent = dy_sent.contiguous()
        dy_recv = dy_sent.new_empty((sum(plan.recv_splits), ) + tuple(dy_sent.shape[1:]))
        dx_recv = torch.empty_like(dy_recv)
        dx_send = torch.empty_like(dy_sent)
        dw_recv = None
        if ctx.has_w:  # every received row belongs to one unit: all of it is written
            dw_recv = torch.empty(ctx.w_meta[0], dtype=ctx.w_meta[1], device=dy_sent.device)
        graphs, weights, lora_leaves = ctx.graphs, ctx.weights, ctx.lora_leaves
        if experts.remat:  # fetch the replicas once, rebuild the weights' graph once
            replica = experts.source.rematerialized().detach().requires_grad_(experts.rows.requires_grad)
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in ctx.leaves]
            with torch.enable_grad():
                fn, weights, lora_leaves = experts.build(leaves, replica)
        w_names = list(weights)
        w_tensors = [weights[n] for n in w_names]
        targets = [t for t in w_tensors + list(lora_leaves) if t.requires_grad]
        sums = [None] * len(targets)

        def grads(units: list) -> None:
            xs, ws, ys, gs = [], [], [], []
            for u in units:
                pos, sizes, tables = plan.units[u]
                if pos.numel() == 0:
                    continue
                if experts.remat:
                    with torch.enable_grad():
                        x = ctx.x_recv.index_select(0, pos).requires_grad_(True)
                        w = None if not ctx.has_w else ctx.w_recv.index_select(0, pos).requires_grad_(True)
                        y = _unit_fn(fn, x, w, sizes, tables)
                else:
                    x, w, y = graphs.pop(u)
                xs.append((x, pos))
                if w is not None:
                    ws.append((w, pos))
                ys.append(y)
                gs.append(dy_recv.index_select(0, pos))
            if not ys:
                return
            leaves = [x for x, _ in xs] + [w for w, _ in ws]
            out = torch.autograd.grad(ys, leaves + targets, gs, allow_unused=True)
            dsts = [dx_recv] * len(xs) + [dw_recv] * len(ws)
            for dst, (x, pos), g in zip(dsts, xs + ws, out[:len(leaves)]):
                dst.index_copy_(0, pos, g if g is not None else torch.zeros_like(x))
            for j, g in enumerate(out[len(leaves):]):
                if g is not None:
                    sums[j] = g if sums[j] is None else sums[j] + g

        d_side = []

        def side_backward() -> None:  # the side work's gradient through its own graph (weights: accumulated)
            leaf, y = ctx.side
            with torch.enable_grad():
                torch.autograd.backward(y, dside)
            d_side.append(leaf.grad)

        side_back = side_backward if ctx.side is not None and dside is not None else None
        plan.run(b, groups, world, dy_sent, dy_recv, dx_recv, dx_send, grads, after=side_back)
        # Weight gradients: named [S + R, ...] sums -> rows; LoRA leaves as they are.
        by_target = {id(t): g for t, g in zip(targets, sums)}
        named = {n: (by_target.get(id(t)) if by_target.get(id(t)) is not None else torch.zeros_like(t))
                 for n, t in zip(w_names, w_tensors)}
        d_rows_all = experts.spec.flatten(named)
        S0 = experts.rows.shape[0]
        d_rows, d_replica = d_rows_all[:S0], d_rows_all[S0:]
        out = [d_rows if ctx.needs[0] else None]
        k = 1
        if experts.remat:
            experts.source.replica_grad_ready(d_replica)
        else:
            out.append(d_replica if ctx.needs[1] else None)
            k = 2
        for leaf, need in zip(lora_leaves, ctx.needs[k:]):
            g = by_target.get(id(leaf))
            out.append((g if g is not None else torch.zeros_like(leaf)) if need else None)
        ctx.graphs = ctx.weights = ctx.x_recv = ctx.w_recv = ctx.side = None
        return (dx_send, dw_recv if ctx.needs_w else None, None, None, None, None, None, None,
                d_side[0] if d_side else None, *out)


def run_pipelined_experts(send_RH: torch.Tensor, w_recv_UK: torch.Tensor | None, plan, experts: PipelineExperts,
                          groups: ExchangeGroups, world: int, side=None) -> torch.Tensor:
    """:class:`PipelinedExperts` over ``plan`` (a :class:`ChunkPlan` or ``relay.RelayPlan``), its
    graphs recorded when a backward may follow. ``side``: the layer's ``moe.side.SideWork``
    (computed beside the exchange and delivered), or None."""
    tensors = experts.inputs()
    record = torch.is_grad_enabled() and (send_RH.requires_grad or (w_recv_UK is not None and w_recv_UK.requires_grad)
                                          or any(t.requires_grad for t in tensors))
    if side is None:
        return PipelinedExperts.apply(send_RH, w_recv_UK, plan, experts, groups, world, record, None, None, *tensors)
    y_sent, side_y = PipelinedExperts.apply(send_RH, w_recv_UK, plan, experts, groups, world, record,
                                            (side.fn, torch.is_grad_enabled()), side.x_TH, *tensors)
    side.deliver(side_y)
    return y_sent


def pipelined_dispatch_compute_combine(x_TH: torch.Tensor, weights_TK: torch.Tensor, route, *,
                                       experts: PipelineExperts, degrees: tuple, groups: ExchangeGroups, rank: int,
                                       world: int, side=None) -> torch.Tensor:
    """``compute.dispatch_compute_combine`` with the exchange + expert compute chunked at
    ``degrees`` (forward, backward): the same send buffer and the same combine around one
    :class:`PipelinedExperts`."""
    dev = x_TH.device
    T, K = weights_TK.shape
    unsend_TK = functools.cache(lambda: route.unsend.to(dev).view(T, K))
    send_RH = ops.permute_tokens(x_TH, route.send_token, unsend_TK)
    plan = ChunkPlan(rank=rank, degrees=degrees, send_splits=route.send_splits, recv_splits=route.recv_splits,
                     group_perm=route.group_perm, group_sizes=route.group_sizes, device=dev)
    y_sent_RH = run_pipelined_experts(send_RH, None, plan, experts, groups, world, side)
    return ops.unpermute_combine(y_sent_RH, unsend_TK(), weights_TK)


def pipelined_dispatch_compute_combine_dedup(x_TH: torch.Tensor, weights_TK: torch.Tensor, droute, *,
                                             experts: PipelineExperts, degrees: tuple, groups: ExchangeGroups,
                                             rank: int, world: int, exchange, side=None) -> torch.Tensor:
    """``compute.dispatch_compute_combine_dedup`` over one hop chunked at ``degrees``: one row per
    (token, destination) crosses in the chunks, through :class:`PipelinedExperts` with the
    receiver's tables (two hops: ``moe/relay.py``). The gate weights of the sent rows (zero on the
    slots a row does not carry there) cross in one unchunked all-to-all (K values per row, with
    autograd) before the chunks; the receiver applies them per unit, so the return carries one row
    per received row and the sender sums a token's partial rows over its destinations
    (destination order)."""
    dev = x_TH.device
    (hop, ) = droute.hops
    send_UH, w_UK = hop_buffers(x_TH, weights_TK, hop)
    w_recv_UK = exchange(w_UK, hop.recv_splits, hop.splits)
    plan = ChunkPlan(rank=rank, degrees=degrees, send_splits=hop.splits, recv_splits=hop.recv_splits,
                     group_perm=None, group_sizes=droute.route.group_sizes, device=dev,
                     expand=(droute.rows_UK, droute.token_C))
    out_RH = run_pipelined_experts(send_UH, w_recv_UK, plan, experts, groups, world, side)
    return ops.unpermute_combine(out_RH, hop.uniq_TK.to(dev))
