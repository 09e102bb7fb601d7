"""Per-rank RNG states (torch, Python, NumPy, the accelerator) as plain tensors and tuples."""
from __future__ import annotations

import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator


def rng_state(device) -> dict:
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_gauss),
                       float(np_cached))}
    if torch.device(device).type != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    if "accelerator" in state and torch.device(device).type != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])
