"""Expert compute and token permutation ops (installed as ``ds_fssdp.ops``).

Pure tensor functions with autograd that never talk to other ranks. Each runs the Triton kernels
on CUDA tensors and the torch reference elsewhere, chosen once per device type and logged
(``ds_fssdp.ops.dispatch``); triton is imported only when a kernel is about to run.
"""
from ds_fssdp.ops.activations import ACTIVATIONS
from ds_fssdp.ops.expert_mlp import expert_mlp
from ds_fssdp.ops.group_sizes import GroupSizes
from ds_fssdp.ops.grouped_gemm import grouped_gemm
from ds_fssdp.ops.permute import permute_tokens, unpermute_combine

__all__ = ["ACTIVATIONS", "expert_mlp", "GroupSizes", "grouped_gemm", "permute_tokens", "unpermute_combine"]
