"""The single-process reference of the SP and TP equivalence tests: each step, the data-parallel
replicas' losses on the full batches, their gradients averaged (times DeepSpeed's extra scale),
one global-norm clip that must engage, SGD + momentum."""
from __future__ import annotations

import torch


def sgd_reference(model, loss_of, *, steps: int, dp: int, lr: float, momentum: float, clip: float, scale=1.0):
    """``loss_of(model, step, g)``: replica g's loss at ``step``. Returns ({(step, g): loss}, state dict)."""
    model.train()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    losses, norms = {}, []
    for step in range(steps):
        opt.zero_grad()
        for g in range(dp):
            loss = loss_of(model, step, g)
            (loss * scale / dp).backward()
            losses[(step, g)] = loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
    assert max(norms) > clip  # clipping engaged
    return losses, model.state_dict()
