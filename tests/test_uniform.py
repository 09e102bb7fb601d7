"""Uniform routing once (planner.baselines.ep.uniform_split): the runtime's gate
(moe/gate.uniform_assignment), the planner's policy (UniformPolicy.route) and the cluster engine
(every group at once) split a rank's assignments the same way, the remainder of rank d on experts
d, d + 1, ... (mod E), whatever T*K mod E is."""
import numpy as np
import pytest
import torch

from ds_fssdp.moe.gate import GateOutput, uniform_assignment
from ds_fssdp.planner.baselines.ep import uniform_split, uniform_tokens

E = 8


def gate_counts(T: int, K: int, rank: int) -> torch.Tensor:
    idx_TK = torch.zeros(T, K, dtype=torch.long)
    g = uniform_assignment(GateOutput(idx_TK, torch.ones(T, K), None, torch.zeros(E)), E, rank=rank)
    return g.counts_E


@pytest.mark.parametrize("T,K", [(16, 2), (33, 1), (11, 2), (5, 1), (3, 2)])  # T*K mod 8: 0, 1, 6, 5, 6
def test_gate_policy_and_cluster_split_alike(T, K):
    D = 6
    counts_ED = torch.stack([gate_counts(T, K, d) for d in range(D)], 1)
    raw_ED = torch.zeros(E, D, dtype=torch.long)
    raw_ED[0] = T * K  # the gate's own choice does not matter: only each rank's total
    assert torch.equal(uniform_tokens(raw_ED), counts_ED)
    # the cluster engine: groups of D ranks and layers at once, ranks numbered inside their group
    raw_LBED = np.stack([np.stack([raw_ED.numpy(), np.roll(raw_ED.numpy(), 3, 0)])] * 2)
    assert np.array_equal(uniform_split(raw_LBED), np.broadcast_to(counts_ED.numpy(), raw_LBED.shape))
    r = (T * K) % E
    for d in range(D):  # the remainder on experts d .. d + r - 1
        extra = [(d + i) % E for i in range(r)]
        assert sorted(torch.nonzero(counts_ED[:, d] > (T * K) // E).flatten().tolist()) == sorted(extra)


def test_the_old_gate_offset_disagreed():
    """Negative control: the gate's former offset (rank x T*K) puts the remainder elsewhere as soon
    as T*K mod E is neither 0 nor 1, which the test above would catch."""
    T, K, d = 11, 2, 3
    idx = (torch.arange(T * K) + d * T * K) % E
    old = torch.bincount(idx, minlength=E)
    assert not torch.equal(old, gate_counts(T, K, d))
