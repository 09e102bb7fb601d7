"""Two hops, both chunked: the relay hop across nodes pipelined with the hop inside the node and
the expert compute (one copy per destination across nodes, ``moe/dedup.py``; DeepEP forwards a
token over NVLink while the next ones cross nodes).

Legend: V relay-hop rows (one per (token, destination node)), U last-hop rows (one per (relay
row, destination)), A atoms, D ranks, H hidden.

A :class:`RelayPlan` is the plan :class:`~ds_fssdp.moe.pipeline.PipelinedExperts` runs when the
route has two hops and the degrees are not (1, 1):

* **Cuts.** The relay hop's (source, relay) pairs are cut at the atoms of the forward and backward
  degrees, as :class:`~ds_fssdp.moe.pipeline.ChunkPlan` cuts a pair; this rank's own block (its
  node's rows) needs no relay hop and is copied whole first. A relay row's atom is its
  **stage**, except that the rows of this rank's own tokens on its own experts are stage A, the
  local stage. The relay's last-hop send order is (destination, stage, row) (``dedup.hop_tables``
  with ``stage_TK``), so every stage is one block per destination, and each destination learns the
  blocks' sizes from the last hop's count all-gather (``Hop.recv_stage_splits``).
* **Order** (one direction at degree n; ``planner.schedule.relay_order`` issues the same): relay
  chunk 0 is launched on the node link and the local stage computed while it flies; then per
  step t: launch relay chunk t + 1, land chunk t and launch its hop inside the node; land chunk
  t - 1's hop, ``work`` its atoms at the final receiver and launch their hop back; land chunk
  t - 2's hop back, sum each of its relay rows' returned rows (destination order) and launch its
  relay return. Every exchange is asynchronous; the returns land at the end.
* **Both directions are the same schedule**: the forward copies rows out and sums outputs back,
  the backward copies output gradients out and sums input gradients back (the relay's gather and
  sum are each other's adjoints), so :meth:`RelayPlan.run` serves both, like ``ChunkPlan.run``.

The sums are the unchunked path's (``compute.dispatch_compute_combine_dedup``): each relay row's
returned rows in destination order, each source row's in relay order.
"""
from __future__ import annotations

import torch

from ds_fssdp import ops
from ds_fssdp.moe.compute import hop_weights
from ds_fssdp.moe.pipeline import (Cuts, ExchangeGroups, _expanded_units, _offsets, atom_of_rows, block_ranges,
                                   run_pipelined_experts, start_exchange)


class RelayPlan(Cuts):
    """The cuts of one two-hop dispatch (this rank's view: as source, relay and final receiver).

    ``relay``, ``last``: the route's :class:`~ds_fssdp.moe.dedup.Hop` s, ``last`` staged (A + 1
    stages: the A atoms, then A for this rank's own rows). ``units`` as
    :class:`~ds_fssdp.moe.pipeline.ChunkPlan`'s with ``expand``: per stage the last-hop received
    rows, rows per local slot and expand tables. ``recv_splits``: the last hop's (the final
    receiver's buffer); ``send_splits``: the relay hop's (the source's)."""

    def __init__(self, *, rank: int, degrees: tuple, relay, last, rows_UK: torch.Tensor, token_C: torch.Tensor,
                 group_sizes: list, device=None):
        super().__init__(rank, degrees)
        A, S = len(self.cuts) - 1, len(group_sizes)
        if last.stage_splits is None or last.stage_splits.shape[1] != A + 1:
            raise ValueError(f"RelayPlan: the last hop must be staged by the {A} atoms of degrees {self.degrees} "
                             "and the local rows (dispatcher.route with the same degrees)")
        self.v_send, self.v_recv = [int(n) for n in relay.splits], [int(n) for n in relay.recv_splits]
        self.v_send_off, self.v_recv_off = _offsets(self.v_send), _offsets(self.v_recv)
        self.send_splits, self.recv_splits = self.v_send, [int(n) for n in last.recv_splits]
        # The last hop's stage blocks: row offsets [D, A + 2] in the send and receive buffers.
        self.u_send_DA = _block_offsets(last.stage_splits)
        self.u_recv_DA = _block_offsets(last.recv_stage_splits)
        stage_V = atom_of_rows(self.v_recv, self.cuts)
        self.rel_rows = [torch.nonzero(stage_V == a).flatten().to(device) for a in range(A)]
        slot_C = torch.repeat_interleave(torch.arange(S), torch.tensor(group_sizes, dtype=torch.long))
        self.units = _expanded_units(_stage_of_blocks(last.recv_stage_splits), slot_C, rows_UK, token_C, A=A, S=S,
                                     device=device)
        self.token_U, self.uniq_TK = last.token_U.to(device), last.uniq_TK.to(device)
        self.u_send = int(last.stage_splits.sum())

    def _relay_ranges(self, side: str, q0, q1) -> list:
        """:func:`~ds_fssdp.moe.pipeline.block_ranges` of the relay hop (this rank's block is copied
        whole first)."""
        splits, off = (self.v_send, self.v_send_off) if side == "send" else (self.v_recv, self.v_recv_off)
        return block_ranges(splits, off, self.rank, q0, q1)

    def _last_ranges(self, side: str, s0: int, s1: int) -> list:
        """Rows [lo, hi) of stages s0 .. s1 - 1 in each peer's last-hop block."""
        off = self.u_send_DA if side == "send" else self.u_recv_DA
        return [(int(off[d, s0]), int(off[d, s1])) for d in range(off.shape[0])]

    def run(self, degree: int, groups: ExchangeGroups, world: int, src_VH: torch.Tensor, recv_UH: torch.Tensor,
            back_recv_UH: torch.Tensor, back_sent_VH: torch.Tensor, work, after=None) -> None:
        """One direction (module docstring; ``planner.schedule.relay_order``): ``src_VH`` (the
        source's relay send order) out to the final receivers' ``recv_UH``, ``work(units)`` fills
        ``back_recv_UH`` at their rows, and the sums come back into ``back_sent_VH``; ``after()``
        (the work beside the exchange) once the last relay return is launched."""
        rank, A = self.rank, len(self.cuts) - 1
        tail = tuple(src_VH.shape[1:])
        rel_VH = src_VH.new_empty((sum(self.v_recv), ) + tail)
        back_rel_VH = torch.empty_like(rel_VH)
        out_UH = src_VH.new_empty((self.u_send, ) + tail)
        back_UH = torch.empty_like(out_UH)

        def inside(src, src_ranges, dst, dst_ranges, exchange=True):  # the hop inside the node
            (slo, shi), (dlo, dhi) = src_ranges[rank], dst_ranges[rank]
            if shi > slo:  # this rank's block: copied
                dst[dlo:dhi].copy_(src[slo:shi])
            if not exchange:
                return None
            src_ranges, dst_ranges = list(src_ranges), list(dst_ranges)
            src_ranges[rank] = dst_ranges[rank] = None
            return start_exchange(groups, rank, world, src, src_ranges, dst_ranges, links=("intra", ))

        def relay_chunk(j):  # chunk j of the relay hop (node link), landed into rel_VH
            q0, q1, _ = self.chunk(degree, j)
            return start_exchange(groups, rank, world, src_VH, self._relay_ranges("send", q0, q1),
                                  self._relay_ranges("recv", q0, q1), links=("inter", ))

        def stages(j):  # chunk j's stages (its atoms), as a [s0, s1) range
            _, _, atoms = self.chunk(degree, j)
            return atoms[0], atoms[-1] + 1

        def forward_inside(s0, s1, exchange=True):  # the relay's rows of stages s0..s1-1 to their destinations
            send_r, recv_r = self._last_ranges("send", s0, s1), self._last_ranges("recv", s0, s1)
            pos_U = _positions(send_r, out_UH.device)
            out_UH.index_copy_(0, pos_U, rel_VH.index_select(0, self.token_U.index_select(0, pos_U)))
            return inside(out_UH, send_r, recv_UH, recv_r, exchange)

        lo, hi = self.v_send_off[rank], self.v_send_off[rank] + self.v_send[rank]
        rlo, rhi = self.v_recv_off[rank], self.v_recv_off[rank] + self.v_recv[rank]
        rel_VH[rlo:rhi].copy_(src_VH[lo:hi])  # this node's rows: no relay hop
        relays = {0: relay_chunk(0)}
        forward_inside(A, A + 1, exchange=False)  # this rank's own rows: no exchange at all
        work([A])
        inside(back_recv_UH, self._last_ranges("recv", A, A + 1), back_UH, self._last_ranges("send", A, A + 1),
               exchange=False)
        hops, backs, returns = {}, {}, []
        for t in range(degree + 2):
            if t < degree:
                if t + 1 < degree:
                    relays[t + 1] = relay_chunk(t + 1)
                relays.pop(t).land(rel_VH)
                hops[t] = forward_inside(*stages(t))
            if 1 <= t <= degree:
                s0, s1 = stages(t - 1)
                hops.pop(t - 1).land(recv_UH)
                work(list(range(s0, s1)))
                backs[t - 1] = inside(back_recv_UH, self._last_ranges("recv", s0, s1), back_UH,
                                      self._last_ranges("send", s0, s1))
            if t >= 2:
                s0, s1 = stages(t - 2)
                backs.pop(t - 2).land(back_UH)
                rows_V = torch.cat(self.rel_rows[s0:s1])
                back_rel_VH.index_copy_(0, rows_V, ops.unpermute_combine(back_UH, self.uniq_TK.index_select(0, rows_V)))
                q0, q1, _ = self.chunk(degree, t - 2)
                returns.append(start_exchange(groups, rank, world, back_rel_VH, self._relay_ranges("recv", q0, q1),
                                              self._relay_ranges("send", q0, q1), links=("inter", )))
        if after is not None:
            after()
        back_sent_VH[lo:hi].copy_(back_rel_VH[rlo:rhi])
        for r in returns:
            r.land(back_sent_VH)


def _block_offsets(counts_DA: torch.Tensor) -> torch.Tensor:
    """Row offsets of consecutive (peer, atom) blocks: long [D, A + 1], row d from peer d's first
    row to its end."""
    c = counts_DA.to("cpu", torch.long)
    flat = torch.cumsum(c.flatten(), 0) - c.flatten()
    start_DA = flat.view(c.shape)
    return torch.cat([start_DA, (start_DA[:, -1] + c[:, -1]).unsqueeze(1)], 1)


def _stage_of_blocks(counts_DA: torch.Tensor) -> torch.Tensor:
    """The atom of every row of consecutive (peer, atom) blocks of ``counts_DA`` rows (long, host)."""
    c = counts_DA.to("cpu", torch.long)
    A = c.shape[1]
    return torch.repeat_interleave(torch.arange(A).repeat(c.shape[0]), c.flatten())


def _positions(ranges: list, device) -> torch.Tensor:
    """The rows of ``ranges`` ([lo, hi) per peer), in peer order (long, on ``device``)."""
    parts = [torch.arange(lo, hi) for lo, hi in ranges if hi > lo]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


def relay_dispatch_compute_combine(x_TH: torch.Tensor, weights_TK: torch.Tensor, droute, *, experts, degrees: tuple,
                                   groups: ExchangeGroups, rank: int, world: int, exchange, side=None) -> torch.Tensor:
    """``pipeline.pipelined_dispatch_compute_combine_dedup`` over two staged hops: the rows cross in
    a :class:`RelayPlan`'s chunks; the gate weights cross both hops first, unchunked (K values per
    row, with autograd, through ``exchange``), and the final receiver applies them per unit; each
    source row's returned rows are summed in relay order."""
    dev = x_TH.device
    relay, last = droute.hops
    w_rel_VK = exchange(hop_weights(weights_TK, relay), relay.recv_splits, relay.splits)
    w_recv_UK = exchange(hop_weights(w_rel_VK, last), last.recv_splits, last.splits)
    send_VH = ops.permute_tokens(x_TH, relay.token_U.to(dev), relay.uniq_TK.to(dev))
    plan = RelayPlan(rank=rank, degrees=degrees, relay=relay, last=last, rows_UK=droute.rows_UK,
                     token_C=droute.token_C, group_sizes=droute.route.group_sizes, device=dev)
    y_sent_VH = run_pipelined_experts(send_VH, w_recv_UK, plan, experts, groups, world, side)
    return ops.unpermute_combine(y_sent_VH, relay.uniq_TK.to(dev))

