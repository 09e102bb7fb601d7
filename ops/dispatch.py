"""Which implementation runs an op: the Triton kernels on CUDA tensors, the torch reference on the
CPU. The choice is made once per device type, on purpose, and logged once at INFO.

``DS_FSSDP_OPS_BACKEND`` (read at the first choice for a device type) overrides it:
  auto    (default) CUDA -> triton if an importable triton >= 3.0 is there, else torch (logged,
          with the reason); any other device -> torch.
  torch   the torch reference everywhere.
  triton  the Triton kernels everywhere; an error if triton is missing, and on a non-CUDA device
          it needs TRITON_INTERPRET=1 (the interpreter; tests only, it is slow).

Triton is imported lazily, so ``ds_fssdp.ops`` imports on machines without it.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch
from packaging import version

logger = logging.getLogger(__name__)

ENV = "DS_FSSDP_OPS_BACKEND"
CHOICES = ("auto", "torch", "triton")
MIN_TRITON = version.Version("3.0")

_chosen: dict = {}  # device type -> "torch" | "triton"


def backend_for(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on ``device`` (decided once per device type)."""
    kind = torch.device(device).type
    if kind not in _chosen:
        _chosen[kind], why = _choose(kind)
        logger.info("ds_fssdp.ops: %s tensors use the %s implementation (%s)", kind, _chosen[kind], why)
    return _chosen[kind]


def _choose(kind: str) -> tuple:
    requested = os.environ.get(ENV, "auto")
    if requested not in CHOICES:
        raise ValueError(f"{ENV} ({requested!r}) must be one of {CHOICES}")
    if requested == "torch":
        return "torch", f"{ENV}=torch"
    if requested == "auto" and kind != "cuda":
        return "torch", "the Triton kernels run on CUDA tensors only"
    problem = _triton_problem()
    if requested == "auto":
        return ("torch", problem) if problem else ("triton", f"triton {_triton_version()}")
    if problem:
        raise RuntimeError(f"{ENV}=triton, but {problem}")
    if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV}=triton on {kind} tensors needs TRITON_INTERPRET=1, set before the "
                           "kernels are imported (the Triton interpreter)")
    return "triton", f"{ENV}=triton"


def _triton_problem() -> str:
    """Why the Triton kernels cannot run here ('' when they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    found = version.Version(_triton_version())
    return f"triton {found} is older than {MIN_TRITON}" if found < MIN_TRITON else ""


def _triton_version() -> str:
    return importlib.import_module("triton").__version__
