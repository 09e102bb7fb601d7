"""Cost-model cluster simulator: replay routing traces through FSSDP and the baseline policies.

    python -m ds_fssdp.sim --trace /work/shared/data/trace_e8.npz --cluster a --model gpt-s-moe --gpus 32

Its modules: docs/design.md's module map. Submodules are imported on use, so the runtime can import
:mod:`ds_fssdp.sim.traces` alone.
"""
