"""Expert compute and token permutation ops (installed as ``ds_fssdp.ops``).

Torch reference implementations; they are pure tensor functions with autograd and never talk to
other ranks.
"""
from ds_fssdp.ops.expert_mlp import ACTIVATIONS, expert_mlp
from ds_fssdp.ops.grouped_gemm import grouped_gemm
from ds_fssdp.ops.permute import combine_topk, permute_rows

__all__ = ["ACTIVATIONS", "expert_mlp", "grouped_gemm", "combine_topk", "permute_rows"]
