"""Rows per group for the grouped GEMM, held once and converted on demand.

Legend: G groups, R rows.

The torch path loops over host ints; the Triton path reads int32 sizes and row offsets on the
device. ``expert_mlp`` builds one ``GroupSizes`` and shares it across its GEMMs and their
backward, so each conversion (host->device copy, or device->host sync) happens at most once.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

SizesLike = Union[Sequence[int], torch.Tensor, "GroupSizes"]


class GroupSizes:

    def __init__(self, group_sizes: SizesLike, *, num_groups: int, num_rows: int):
        """Check ``group_sizes`` (host ints, or a 1-D integer tensor) against G and R.

        A host list or CPU tensor is checked to sum to R. A CUDA tensor is not (that would cost a
        host sync); the kernels then clamp every group to the R rows there are.
        """
        self._host: Optional[list] = None
        self._tensor: Optional[torch.Tensor] = None
        self._on_device: dict = {}
        if isinstance(group_sizes, torch.Tensor):
            if group_sizes.dim() != 1 or group_sizes.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"group_sizes must be a 1-D int32/int64 tensor, got {group_sizes.dtype} "
                                 f"{tuple(group_sizes.shape)}")
            if group_sizes.device.type == "cpu":
                self._host = [int(s) for s in group_sizes.tolist()]
            else:
                self._tensor = group_sizes
            count = group_sizes.numel()
        else:
            self._host = [int(s) for s in group_sizes]
            count = len(self._host)
        if count != num_groups:
            raise ValueError(f"{count} group sizes for {num_groups} weights")
        if self._host is not None:
            if any(s < 0 for s in self._host):
                raise ValueError(f"group sizes must be >= 0, got {self._host}")
            if sum(self._host) != num_rows:
                raise ValueError(f"group sizes sum to {sum(self._host)}, but x has {num_rows} rows")
        self.num_groups = num_groups
        self.num_rows = num_rows

    @classmethod
    def of(cls, group_sizes: SizesLike, *, num_groups: int, num_rows: int) -> "GroupSizes":
        if isinstance(group_sizes, GroupSizes):
            if (group_sizes.num_groups, group_sizes.num_rows) != (num_groups, num_rows):
                raise ValueError(f"GroupSizes for {group_sizes.num_groups} groups and {group_sizes.num_rows} "
                                 f"rows used with {num_groups} groups and {num_rows} rows")
            return group_sizes
        return cls(group_sizes, num_groups=num_groups, num_rows=num_rows)

    def host(self) -> list:
        """Host ints (one device->host sync the first time, if they came as a CUDA tensor)."""
        if self._host is None:
            self._host = [int(s) for s in self._tensor.tolist()]
        return self._host

    def sizes_and_offsets(self, device: torch.device) -> tuple:
        """(sizes_G, offsets_G1) as int32 on ``device``; offsets_G1 = [0, cumsum(sizes)]."""
        key = torch.device(device)
        if key not in self._on_device:
            if self._tensor is not None:
                sizes_G = self._tensor.to(device=key, dtype=torch.int32)
            else:
                sizes_G = torch.tensor(self._host, dtype=torch.int32).to(key, non_blocking=True)
            offsets_G1 = torch.zeros(self.num_groups + 1, dtype=torch.int32, device=key)
            torch.cumsum(sizes_G, 0, dtype=torch.int32, out=offsets_G1[1:])
            self._on_device[key] = (sizes_G, offsets_G1)
        return self._on_device[key]
