"""Every byte that crosses ranks goes through here (over deepspeed.comm, process groups passed in)."""
from ds_fssdp.comm.sparse import SparseAllGather, SparseReduceScatter, scatter_rows
from ds_fssdp.comm.tokens import all_gather_counts, all_to_all

__all__ = ["SparseAllGather", "SparseReduceScatter", "scatter_rows", "all_gather_counts", "all_to_all"]
