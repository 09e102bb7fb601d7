"""Every byte that crosses ranks goes through here (over deepspeed.comm, process groups passed in)."""
from ds_fssdp.comm.sparse import sparse_all_gather, sparse_reduce_scatter
from ds_fssdp.comm.tokens import all_gather_counts, all_to_all

__all__ = ["sparse_all_gather", "sparse_reduce_scatter", "all_gather_counts", "all_to_all"]
