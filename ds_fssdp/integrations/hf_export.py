"""An engine checkpoint of a converted HF model, exported offline as a Hugging Face directory, one
layer of experts at a time (docs/design.md section 5, "Big models in and out").

Legend: E experts, P elements per expert row.

    python -m ds_fssdp.integrations.hf_export CHECKPOINT_DIR OUT_DIR --model HF_MODEL_DIR_OR_NAME \\
        [--tag TAG] [--dtype bfloat16] [--max-shard-size 5GB] [--trust-remote-code]

One process: the model (``--model``, for its config) on the meta device, converted; the dense
weights from DeepSpeed's files (``runtime/checkpoint/export.dense_state_dict``); each experts
module's fp32 master rows from the rank files, written by ``hf_save.write_hf_dir``.
"""
from __future__ import annotations

import argparse
import os

import torch

from ds_fssdp.runtime.checkpoint.files import CheckpointError


def export_hf(load_dir: str, out_dir: str, *, model: str, tag=None, dtype=None, max_shard_size="50GB",
              verify: bool = True, **hf_kwargs) -> str:
    """Write the checkpoint ``tag`` (default ``latest``) of ``load_dir`` as a Hugging Face directory
    ``out_dir`` (new or empty), the config read from ``model``, tensors in ``dtype`` (default: the config's)."""
    import transformers

    from ds_fssdp.integrations.hf import convert, converted_experts, expert_keys
    from ds_fssdp.integrations.hf_load import _hf_zero3_off
    from ds_fssdp.integrations.hf_save import write_hf_dir
    from ds_fssdp.runtime.checkpoint.export import all_rows, dense_state_dict, open_checkpoint
    from ds_fssdp.runtime.checkpoint.reshape import RankFiles
    root, meta = open_checkpoint(load_dir, tag, verify=verify)
    config = transformers.AutoConfig.from_pretrained(model, **hf_kwargs)
    dtype = _dtype(dtype if dtype is not None else getattr(config, "dtype", None) or torch.float32)
    with _hf_zero3_off(), torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **hf_kwargs)
    convert(skeleton, route_initialize=False)
    modules = dict(converted_experts(skeleton))
    layers = {saved["name"]: (l, saved) for l, saved in enumerate(meta["layers"])}
    if set(layers) != set(modules):
        raise CheckpointError(f"{root}: the checkpoint's expert layers {sorted(layers)} are not the experts modules "
                              f"of {model} ({sorted(modules)}): export with the model it was trained from")
    for name, module in modules.items():
        l, saved = layers[name]
        if saved["num_experts"] != module.num_experts or saved["numel"] != module.spec.numel:
            raise CheckpointError(f"{root}: layer {l} ({name}) holds {saved['num_experts']} experts of {saved['numel']} "
                                  f"elements; {model} has {module.num_experts} of {module.spec.numel}")
    files = RankFiles(root)

    def dense() -> dict:
        state = dense_state_dict(load_dir, os.path.basename(root), meta)
        want = set(skeleton.state_dict()) - expert_keys(skeleton)
        missing = sorted(want - set(state) - set(skeleton.all_tied_weights_keys))
        if missing:
            raise CheckpointError(f"{root}: the dense weights lack {missing[:5]} ({len(missing)} keys of {model})")
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k in want}

    def rows(module):
        l, saved = layers[next(n for n, m in modules.items() if m is module)]
        return torch.arange(saved["num_experts"]), all_rows(files, l, saved)

    return write_hf_dir(skeleton, out_dir, dense=dense, rows=rows, dtype=dtype, max_shard_size=max_shard_size)


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"--dtype ({value!r}) is not a torch dtype (float32, bfloat16, float16)")
    return getattr(torch, name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_fssdp.integrations.hf_export", description=__doc__.split("\n\n")[0])
    parser.add_argument("load_dir", help="the engine checkpoint directory (save_checkpoint's save_dir)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write (new or empty)")
    parser.add_argument("--model", required=True, help="the HF model directory or hub name trained (its config)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--dtype", default=None, help="dtype of the saved tensors (default: the config's)")
    parser.add_argument("--max-shard-size", default="50GB")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--no-verify", action="store_true", help="check sizes only, not sha256 digests")
    args = parser.parse_args(argv)
    kwargs = {"trust_remote_code": True} if args.trust_remote_code else {}
    print(export_hf(args.load_dir, args.out_dir, model=args.model, tag=args.tag, dtype=args.dtype,
                    max_shard_size=args.max_shard_size, verify=not args.no_verify, **kwargs))


if __name__ == "__main__":
    main()
