"""Checkpoints of a pipeline-parallel engine: experts keyed by their global MoE layer index
(docs/design.md section 9, "Checkpoints"). Each stage's ranks write their own layers' rows, predictor
windows and expert optimizer scalars; ``fssdp/meta.json`` lists every stage's layers in global order,
each with ``stage``, ``first_rank`` (its first FSSDP group's files hold every expert of the layer)
and ``local`` (its position there). Another number of stages is refused by name.
"""
from __future__ import annotations

import os

from ds_fssdp.runtime.checkpoint.collective import all_gather
from ds_fssdp.runtime.checkpoint.files import CheckpointError
from ds_fssdp.runtime.checkpoint.layout import META


def stages_of(stage) -> int:
    """The engine's pipeline stages (1 without pipelining)."""
    return 1 if stage.layout is None else stage.layout.num_stages


def every_stage_layers(stage, layers: list) -> list:
    """Every stage's layer descriptions (``layers``: this stage's) in global order, each with its
    stage, the stage's first rank and its local position. Collective over the world."""
    layout = stage.layout
    first = layout.stages[layout.stage_id][0]
    mine = [dict(d, stage=layout.stage_id, first_rank=first, local=l) for l, d in enumerate(layers)]
    out = {g: d for part, indices in all_gather((mine, list(stage.global_layers))) for g, d in zip(indices, part)}
    return [out[g] for g in range(len(out))]


def saved_place(meta: dict, g: int) -> tuple:
    """``(base, local)``: where layer ``g``'s rows were written (files ``base + owner``, position
    ``local`` in them); ``(0, g)`` for a checkpoint without pipelining."""
    saved = meta["layers"][g]
    return int(saved.get("first_rank", 0)), int(saved.get("local", g))


def check_stages(stage, meta: dict, root: str) -> None:
    """Refuse a checkpoint of another stage count: DeepSpeed cannot re-cut a pipeline's dense state
    (another data-parallel size it can, through its universal checkpoint under ZeRO 1,
    ``universal.py``)."""
    saved, mine = int(meta.get("pipeline_stages", 1)), stages_of(stage)
    if saved != mine:
        raise CheckpointError(f"{os.path.join(root, META)}: saved with {saved} pipeline stage(s), this engine runs "
                              f"{mine}: DeepSpeed keeps a pipeline's dense optimizer state per stage, so a checkpoint "
                              f"resumes only with the stage count that wrote it (--pipeline-stages {saved})")
