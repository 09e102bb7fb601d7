"""Cost-model cluster simulator: replay routing traces through FSSDP and the baseline policies.

    python -m ds_fssdp.sim --trace /work/shared/data/trace_e8.npz --cluster a --model gpt-s-moe --gpus 32

Pieces: ``presets`` (the paper's clusters and Table 1 models), ``setup`` (derived knobs),
``traces`` (file format, writer), ``synth`` / ``remap`` / ``workload`` (what to replay),
``prediction`` (load-prediction R^2), ``simulate`` (the accounting), ``report`` / ``plot`` (output).
Submodules are imported on use, so the runtime can import :mod:`ds_fssdp.sim.traces` alone.
"""
