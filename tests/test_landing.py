"""The rows' landing (moe/replicas.py ReplicaManager.land): it runs the pending write once, and
outside inference mode even when called in it (an evaluation forward under
``torch.inference_mode``), so what a landing creates (a split step's first optimizer state) is an
ordinary tensor that later steps may update in place."""
import types

import torch

from ds_fssdp.moe.replicas import ReplicaManager


def test_a_landing_in_inference_mode_creates_ordinary_tensors_and_runs_once():
    made, calls = [], []

    def landing():
        calls.append(torch.is_inference_mode_enabled())
        made.append(torch.zeros(3))  # as an optimizer's first step creates its moments

    manager = types.SimpleNamespace(_landing=landing, landing_s=0.0)
    with torch.inference_mode():
        ReplicaManager.land(manager)
        ReplicaManager.land(manager)  # nothing pending any more
    assert calls == [False] and manager._landing is None and manager.landing_s >= 0.0
    assert not made[0].is_inference()
    made[0].add_(1.0)  # an inference tensor would refuse this outside inference mode
