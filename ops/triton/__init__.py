"""Triton kernels behind ``ds_fssdp.ops`` (imported lazily by the ops, only where
``dispatch.backend_for`` chose Triton; importing this package does not import triton)."""
