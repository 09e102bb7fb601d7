"""Where a converted experts module's tensors are in a Hugging Face checkpoint, both ways, read off
transformers' own conversion mapping, with no table of families (docs/design.md section 5, "Big
models in and out").

Legend: E experts, S experts read or written here (a rank's own).

A checkpoint holds an experts module's tensors fused ([E, ...]) or one per expert
(``experts.{e}.w1.weight``), which the family's ``WeightConverter`` fuses at load and its reverse
splits at save. Load: :func:`plan_experts` (checked on every rank alike before anything is read),
:func:`read_owned`. Save: :class:`SavedExperts`.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch

from ds_fssdp.integrations.safetensors_io import Planned, _runs
from ds_fssdp.runtime.checkpoint.files import CheckpointError

# Ops that act on each expert alone: the stacking of per-expert tensors on dim 0, and ops on dims >= 1.
_PER_EXPERT_DIM_OPS = ("Concatenate", "Chunk", "Split", "Interleave")


class UnmappableExpertsError(ValueError):
    """transformers' conversion of an experts tensor does not act per expert."""


@dataclass
class TensorSource:
    """Where one HF experts tensor (``module.attr``, [E, ...]) comes from in the checkpoint."""
    target: str  # the model's name of the tensor
    shape: tuple  # its full shape
    converter: object = None  # transformers' WeightConverter (None: a key renamed, or not, onto it)
    keys: dict = field(default_factory=dict)  # source pattern (or the key) -> [key of expert e] or [fused key]
    per_expert: bool = False


def hf_shapes(module) -> dict:
    """The HF tensors of a converted experts module: attribute -> full shape."""
    return {n: tuple(p.shape) for n, p in module._hf_experts.named_parameters(recurse=False)}


def split_mapping(weight_mapping) -> tuple:
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    renamings = [t for t in weight_mapping or [] if isinstance(t, WeightRenaming)]
    converters = [t for t in weight_mapping or [] if isinstance(t, WeightConverter)]
    return renamings, converters


def plan_experts(model, modules: list, files, weight_mapping, *, model_type: str) -> dict:
    """``{module name: {attr: TensorSource}}`` for the converted ``modules`` ([(name, module)]), checked
    against the checkpoint ``files``' keys and shapes: raises naming the key, the file or the op."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key
    renamings, converters = split_mapping(weight_mapping)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    plan = {name: {attr: TensorSource(target=f"{name}.{attr}" if name else attr, shape=shape)
                   for attr, shape in hf_shapes(module).items()} for name, module in modules}
    sources = {s.target: s for tensors in plan.values() for s in tensors.values()}
    # What transformers matches names against (its meta state dict): the dense keys and the HF
    # tensors of the converted modules.
    known = dict.fromkeys([*model.state_dict(), *sources], True)
    for key in sorted(files.keys(), key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, known)
        source = sources.get(renamed)
        if source is None:
            continue
        if pattern is None:
            source.keys.setdefault(key, []).append(key)
            continue
        converter = by_pattern[pattern]
        if source.converter is not None and source.converter is not converter:
            raise CheckpointError(f"{renamed}: checkpoint keys of two different conversions land on it ({key})")
        source.converter = converter
        if "*" in pattern:
            source.per_expert = True
            source.keys.setdefault(pattern, {})[_expert_index(pattern, key)] = key
        else:
            source.keys.setdefault(pattern, []).append(key)
    for name, module in modules:
        for source in plan[name].values():
            _check(source, files, model_type=model_type, num_experts=module.num_experts, config=model.config)
    return plan


def _expert_index(pattern: str, key: str) -> int:
    if pattern.count("*") != 1 or "*." not in pattern:
        raise UnmappableExpertsError(f"{key}: transformers' pattern {pattern!r} has no single per-expert index")
    m = re.search(pattern.replace("*.", r"(\d+)\."), key)
    if m is None:
        raise UnmappableExpertsError(f"{key}: no expert index where transformers' pattern {pattern!r} has '*'")
    return int(m.group(1))


def _check(source: TensorSource, files, *, model_type: str, num_experts: int, config) -> None:
    E, where = num_experts, source.target
    if not source.keys:
        looked = list(source.converter.source_patterns) if source.converter is not None else [where]
        raise CheckpointError(f"{where} (model_type {model_type!r}): the checkpoint has no tensor for it (looked for "
                              f"{looked} in {len(files.paths)} safetensors files: {_dir(files)})")
    if source.converter is not None:
        _check_ops(source, model_type=model_type)
    if source.per_expert:
        for pattern in source.converter.source_patterns:
            found = source.keys.get(pattern, {})
            if not found:
                raise CheckpointError(f"{where}: the checkpoint has no tensor matching {pattern!r} (per-expert keys "
                                      f"of the other source(s): {_sample(source.keys)}) in {_dir(files)}")
            extra = sorted(e for e in found if e >= E)
            if extra:
                raise CheckpointError(f"{where}: the checkpoint has {max(found) + 1} experts for {pattern!r} "
                                      f"({found[extra[0]]}), the config has {E}")
            missing = [e for e in range(E) if e not in found]
            if missing:
                sibling = next(iter(found.values()))
                want = _with_index(sibling, pattern, missing[0])
                raise CheckpointError(f"{where}: the checkpoint has no tensor {want!r} (expert {missing[0]} of {E}; "
                                      f"{len(found)} found for {pattern!r}) in {_dir(files)}")
            shapes = {files.entry(k).shape for k in found.values()}
            if len(shapes) > 1:
                raise CheckpointError(f"{where}: the per-expert tensors {pattern!r} differ in shape ({sorted(shapes)})")
    else:
        for pattern, keys in source.keys.items():
            if len(keys) > 1:
                raise CheckpointError(f"{where}: several checkpoint keys land on it: {keys}")
            entry = files.entry(keys[0])
            if not entry.shape or entry.shape[0] != E:
                raise CheckpointError(f"{keys[0]} in {entry.path}: shape {list(entry.shape)}, but {where} holds "
                                      f"{E} experts (the config's) on its first dimension")
    # The whole conversion on meta tensors: the model's shape must come out.
    got = _convert(source, lambda key, rows=None: _meta(files.entry(key), rows), list(range(E)), config=config)
    if tuple(got.shape) != tuple(source.shape):
        raise CheckpointError(f"{where}: the checkpoint's tensor(s) {_sample(source.keys)} ("
                              f"{', '.join(str(list(files.entry(k).shape)) for k in _sample(source.keys))}) "
                              f"convert to shape {list(got.shape)}, the model's is {list(source.shape)}")


def _check_ops(source: TensorSource, *, model_type: str) -> None:
    conv = source.converter
    if len(conv.target_patterns) != 1:
        raise UnmappableExpertsError(f"{source.target} (model_type {model_type!r}): transformers' conversion "
                                     f"{type(conv).__name__}({conv.source_patterns} -> {conv.target_patterns}) makes "
                                     "several tensors from one; ds_fssdp reads experts only through conversions with "
                                     "one target")
    for i, op in enumerate(conv.operations):
        name = type(op).__name__
        dims = [getattr(op, a) for a in ("dim", "dim0", "dim1") if hasattr(op, a)]
        stacks = name == "MergeModulelist" and dims == [0] and i == 0 and source.per_expert
        per_expert = (name in _PER_EXPERT_DIM_OPS or name == "Transpose") and dims and min(dims) >= 1
        if not (stacks or per_expert):
            raise UnmappableExpertsError(
                f"{source.target} (model_type {model_type!r}): transformers' conversion of it uses {name}"
                f"({', '.join(f'{a}={getattr(op, a)}' for a in ('dim', 'dim0', 'dim1') if hasattr(op, a))}), which "
                "does not act on each expert alone; ds_fssdp cannot read only a rank's own experts of this family")


def read_owned(source: TensorSource, files, owned_E: torch.Tensor, *, config, dtype) -> torch.Tensor:
    """The experts ``owned_E`` (ascending, at least one) of one HF tensor, [S, ...] in ``dtype``: only
    their bytes are read."""
    return _convert(source, files.read, [int(e) for e in owned_E], config=config).to(dtype)


def _convert(source: TensorSource, read, owned: list, *, config) -> torch.Tensor:
    if source.converter is None:
        (key, ), = source.keys.values()
        return read(key, owned)
    conv = copy.deepcopy(source.converter)  # fresh collected tensors, as transformers copies one per target
    for pattern, keys in source.keys.items():
        if source.per_expert:
            for e in owned:
                conv.add_tensor(source.target, keys[e], pattern, partial(read, keys[e]))
        else:
            conv.add_tensor(source.target, keys[0], pattern, partial(read, keys[0], owned))
    # What a converter's ops ask the model for (``get_parameter(name).shape``): the target's shape
    # with this rank's number of experts.
    shapes = {source.target: (len(owned), *source.shape[1:])}
    model = SimpleNamespace(get_parameter=lambda name: torch.empty(shapes[name], device="meta"))
    out = conv.convert(source.target, model=model, config=config)
    value = out[source.target]
    return value[0] if isinstance(value, list) else value


def _meta(entry, rows=None):
    shape = entry.shape if rows is None else (len(rows), *entry.shape[1:])
    return torch.empty(shape, dtype=entry.dtype, device="meta")


def _with_index(key: str, pattern: str, e: int) -> str:
    m = re.search(pattern.replace("*.", r"(\d+)\."), key)
    return key[:m.start(1)] + str(e) + key[m.end(1):]


def _sample(keys: dict) -> list:
    return [next(iter(v.values())) if isinstance(v, dict) else v[0] for v in keys.values()]


def _dir(files) -> str:
    return os.path.dirname(files.paths[0]) if files.paths else "no files"


class SavedExperts:
    """The tensors ``save_pretrained`` writes for one converted experts module, in ``dtype``, through
    transformers' own reverse conversion (``original_format=False``: the fused keys as the model holds
    them). ``planned``: key, dtype and full shape of each (known on every rank, nothing read);
    :meth:`values`: a rank's own experts' pieces."""

    def __init__(self, model, name: str, module, dtype: torch.dtype, *, original_format: bool = True):
        self.model, self.name, self.original_format, self.dtype = model, name, original_format, dtype
        full = self._revert({attr: torch.empty(shape, dtype=dtype, device="meta")
                             for attr, shape in hf_shapes(module).items()})
        self.shapes = {k: tuple(v.shape) for k, v in full.items()}
        self.patterns = sorted({p for c in self._reversed_converters() for p in c.target_patterns if "*" in p},
                               key=len, reverse=True)
        self.fused = {k for k in self.shapes if self._span(k) is None}
        for k in self.fused:
            if not self.shapes[k] or self.shapes[k][0] != module.num_experts:
                raise UnmappableExpertsError(f"{k}: saved as shape {list(self.shapes[k])}, which does not hold the "
                                             f"{module.num_experts} experts on its first dimension")

    @property
    def planned(self) -> list:
        return [Planned(k, self.dtype, s) for k, s in self.shapes.items()]

    def _revert(self, tensors: dict) -> dict:
        prefix = f"{self.name}." if self.name else ""
        state = {prefix + attr: t for attr, t in tensors.items()}
        if not self.original_format:
            return state
        from transformers.core_model_loading import revert_weight_conversion
        return revert_weight_conversion(self.model, state)

    def _reversed_converters(self) -> list:
        if not self.original_format:
            return []
        conversions = getattr(self.model, "_weight_conversions", None)
        if conversions is None:
            from transformers.conversion_mapping import get_model_conversion_mapping
            conversions = get_model_conversion_mapping(self.model, add_legacy=False)
        _, converters = split_mapping([c.reverse_transform() for c in conversions
                                       if type(c).__name__ != "PrefixChange"])
        return converters

    def _span(self, key: str):
        """Where the expert index is in a per-expert ``key`` (the first pattern, longest first, that
        matches), or None."""
        for pattern in self.patterns:
            m = re.search(re.escape(pattern.replace("\\.", ".")).replace(r"\*", r"(\d+)"), key)
            if m is not None:
                return m.span(1)
        return None

    def values(self, hf_tensors: dict, owned_E: torch.Tensor) -> list:
        """``[(key, tensor, first_row)]`` of a rank's experts ``owned_E`` (ascending) from their HF
        tensors (attr -> [S, ...], in this object's dtype; at least one expert)."""
        owned = [int(e) for e in owned_E]
        out = []
        for key, t in self._revert(hf_tensors).items():
            if key in self.fused:
                i = 0
                for first, count in _runs(owned):
                    out.append((key, t[i:i + count], first))
                    i += count
                continue
            span = self._span(key)
            if span is None:
                raise UnmappableExpertsError(f"{self.name}: the reverse conversion wrote {key}, which is neither a "
                                             "planned fused key nor a per-expert one")
            local = int(key[span[0]:span[1]])
            full = key[:span[0]] + str(owned[local]) + key[span[1]:]
            if full not in self.shapes or tuple(t.shape) != self.shapes[full]:
                raise UnmappableExpertsError(f"{self.name}: expert {owned[local]}'s tensor {full} {list(t.shape)} is "
                                             "not among the planned keys")
            out.append((full, t, 0))
        return out
