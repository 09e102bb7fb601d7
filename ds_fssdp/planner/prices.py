"""The price list: what every transfer and every replica costs, each written once (numpy, scalar
or batched over groups).

Legend: B groups, E experts, N ranks of a group, G ranks per node (N when the group fits in one
node), n nodes of a group, K all-reduce groups, D ranks.

The links of :mod:`ds_fssdp.planner.cost`: every rank has an intra-node link (``intra_bw`` each
way), every node an inter-node link (``inter_bw`` each way). A collective costs one latency plus
the bytes of its busiest link over that link's bandwidth, a link's bytes being its busier
direction, and nothing where nothing moves (:func:`link_seconds`). The cost model
(``planner/cost.py``), the schedule's modelled costs, the simulators' links (``sim/links.py``),
their syncs (``sim/sync.py``) and memory (``sim/memory.py``) take their prices from here.
"""
from __future__ import annotations

import numpy as np

try:  # the planner's C (one import for the planner's modules)
    from ds_fssdp.planner import _fastplan
except ImportError:  # a source tree used without `pip install` (planner/fast.py says so once)
    _fastplan = None

def link_seconds(rank_bytes, node_bytes, hw):
    """Seconds of a collective whose busiest rank link carries ``rank_bytes`` and busiest node
    link ``node_bytes`` (scalars or arrays): one latency plus the slower; 0 where nothing moves."""
    if np.ndim(rank_bytes) == 0 and np.ndim(node_bytes) == 0:  # one collective: the same operations on floats
        rank, node = float(rank_bytes), float(node_bytes)
        if not (rank > 0 or node > 0):
            return 0.0
        a, b = rank / hw.intra_bw, node / hw.inter_bw
        return hw.latency + (a if a >= b or a != a else b)  # np.maximum's pick (NaN first)
    rank = np.asarray(rank_bytes, dtype=np.float64)
    node = np.asarray(node_bytes, dtype=np.float64)
    out = np.where((rank > 0) | (node > 0), hw.latency + np.maximum(rank / hw.intra_bw, node / hw.inter_bw), 0.0)
    return float(out) if out.ndim == 0 else out


def allreduce_share(size):
    """What a ring all-reduce over ``size`` members moves per member, per byte of the message:
    2 (n - 1) / n (0 for one member)."""
    n = np.asarray(size, dtype=np.float64)
    out = np.where(n > 1, 2.0 * (n - 1) / np.maximum(n, 1.0), 0.0)
    return float(out) if out.ndim == 0 else out


def reduce_scatter_share(size):
    """A ring reduce-scatter's (or all-gather's) share: half an all-reduce's, (n - 1) / n."""
    return 0.5 * allreduce_share(size)


def exposed_s(transfer_s, window_s):
    """Seconds of a transfer past the window that hides it (scalars or arrays)."""
    return np.maximum(0.0, np.asarray(transfer_s, dtype=np.float64) - window_s)


def replica_bytes(expert_bytes: float) -> float:
    """Bytes one ephemeral replica of an expert of ``expert_bytes`` holds: its parameters and, until
    the reduce, a gradient of the same size (no optimizer state: the owner steps it)."""
    return 2.0 * expert_bytes


def gather_links(owner_E: np.ndarray, placement_BED: np.ndarray, *, ranks_per_node: int, chunk_bytes: float,
                 relay: bool) -> tuple:
    """``(rank_BN, node_Bn)``: bytes over each link of B groups' SparseAllGathers (or their mirror
    SparseReduceScatters) of ``placement_BED`` from the owners ``owner_E`` (a [E, N] placement is
    one group). Each added replica is one chunk on its rank's link. Across nodes a chunk enters
    each node it newly reaches once; it leaves its owner's node once per node it enters (the
    runtime's collectives, ``planner/transfers.py``), or, under ``relay`` (any node holding a chunk
    forwards it: NCCL's pipelined ring broadcast), once at most."""
    owner_E = np.asarray(owner_E, dtype=np.int64)
    placement_BED = np.asarray(placement_BED, dtype=bool)
    placement_BED = placement_BED.reshape((-1, ) + placement_BED.shape[-2:])
    B, E, N = placement_BED.shape
    G = min(int(ranks_per_node), N)
    if _fastplan is not None:  # the same counts in C
        rank_BN, node_Bn = np.empty((B, N)), np.empty((B, N // G))
        _fastplan.gather_links(np.ascontiguousarray(owner_E), np.ascontiguousarray(placement_BED), rank_BN, node_Bn,
                               B, E, N, G, float(chunk_bytes), bool(relay))
        return rank_BN, node_Bn
    experts = np.arange(E)
    added_BED = placement_BED.copy()
    added_BED[:, experts, owner_E] = False
    rank_BN = added_BED.sum(1).astype(np.float64) * chunk_bytes
    n = N // G
    if n == 1:
        return rank_BN, np.zeros((B, 1))
    entered_BEn = placement_BED.reshape(B, E, n, G).any(3)
    owner_node_E = owner_E // G
    entered_BEn[:, experts, owner_node_E] = False
    node_in_Bn = entered_BEn.sum(1).astype(np.float64)
    leaves_BE = entered_BEn.any(2) if relay else entered_BEn.sum(2)
    idx = (np.arange(B)[:, None] * n + owner_node_E[None, :]).ravel()
    node_out_Bn = np.bincount(idx, weights=leaves_BE.ravel().astype(np.float64), minlength=B * n).reshape(B, n)
    return rank_BN, np.maximum(node_in_Bn, node_out_Bn) * chunk_bytes


def allreduce_links(members_KD: np.ndarray, bytes_K: np.ndarray, *, ranks_per_node: int,
                    share=allreduce_share) -> tuple:
    """``(rank_D, node_n)``: bytes over each link of K ring all-reduces issued together over D
    ranks (group k: the ranks of ``members_KD[k]``, a message of ``bytes_K[k]``): each member's
    link carries ``share`` of its message (:func:`allreduce_share`; a reduce-scatter's or an
    all-gather's: :func:`reduce_scatter_share`), and so does the inter-node link of every node a
    ring that spans nodes passes (ordered by node, it enters and leaves each once)."""
    members_KD = np.asarray(members_KD, dtype=bool)
    K, D = members_KD.shape
    per_member_K = share(members_KD.sum(1)) * np.asarray(bytes_K, dtype=np.float64)
    rank_D = per_member_K @ members_KD.astype(np.float64)
    G = min(int(ranks_per_node), D)
    nodes_Kn = members_KD.reshape(K, D // G, G).any(2)
    spans_K = nodes_Kn.sum(1) > 1
    return rank_D, (per_member_K * spans_K) @ nodes_Kn.astype(np.float64)


def exchange_links(traffic_BNN: np.ndarray, *, ranks_per_node: int, row_bytes: float = 1.0) -> tuple:
    """``(rank_BN, node_Bn, inter_Bn)``: bytes over each link of B exchanges, ``traffic_BNN[b, d, h]``
    rows rank d sends rank h (the diagonal stays home), ``row_bytes`` each: a rank link carries the
    busier direction of what it sends and receives inside its node, a node link the busier of what
    leaves and enters it; ``inter_Bn``: what leaves each node."""
    traffic_BNN = np.asarray(traffic_BNN, dtype=np.float64)
    B, N, _ = traffic_BNN.shape
    G = min(int(ranks_per_node), N)
    n = N // G
    node_N = np.arange(N) // G
    same_NN = node_N[:, None] == node_N[None, :]
    off = traffic_BNN * ~np.eye(N, dtype=bool)
    intra = off * same_NN
    inter = off - intra
    out_Bn = inter.sum(2).reshape(B, n, G).sum(2)
    in_Bn = inter.sum(1).reshape(B, n, G).sum(2)
    return (np.maximum(intra.sum(2), intra.sum(1)) * row_bytes, np.maximum(out_Bn, in_Bn) * row_bytes,
            out_Bn * row_bytes)
