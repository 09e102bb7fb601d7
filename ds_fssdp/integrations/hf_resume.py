"""Resume and preemption for the Hugging Face Trainer on FSSDP.

The Trainer saves ``<output_dir>/checkpoint-<N>`` itself (the engine's atomic checkpoint inside it,
then the Trainer's files, ``trainer_state.json`` last) and resumes the data stream at the exact
next batch from its state. What it lacks: telling a complete checkpoint from one a kill cut short
(``get_last_checkpoint`` takes the highest number), and preemption.

    last = last_complete_checkpoint(output_dir)             # None: start from step 0
    trainer.add_callback(PreemptionCallback(Preemption()))
    trainer.train(resume_from_checkpoint=last)
"""
from __future__ import annotations

import os
import re

import transformers
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint import LATEST, MANIFEST, CheckpointError, read_manifest, resolve_tag, verify_files
from ds_fssdp.runtime.checkpoint.files import read_text
from ds_fssdp.runtime.resume import WHICH, newest_valid

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def last_complete_checkpoint(output_dir: str, *, which: str = "latest") -> str | None:
    """The newest ``checkpoint-<N>`` whose save finished (``trainer_state.json`` written, the
    engine's checkpoint committed with its manifest); unfinished ones are skipped. Its files are
    checked against the manifest; a bad one raises :class:`CheckpointError` naming the file, or
    with ``which="latest-valid"`` the next older complete one is tried. Every rank may call it."""
    if which not in WHICH:  # before looking at the directory
        raise ValueError(f"which ({which!r}) must be one of {WHICH}")
    if not os.path.isdir(output_dir):
        return None
    numbered = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(name))),
                      reverse=True)
    paths = [p for _, name in numbered if os.path.isdir(p := os.path.join(output_dir, name))]
    complete = [p for p in paths if _finished(p)]
    for skipped in (p for p in paths if p not in complete):
        logger.info(f"fssdp: {skipped} is unfinished (a save was cut short); not resuming it")
    return newest_valid(complete, lambda path: verify_files(root := _engine_checkpoint(path), read_manifest(root),
                                                            digests=True), which=which)


class PreemptionCallback(transformers.TrainerCallback):
    """On SIGTERM/SIGUSR1 (see ``ds_fssdp.Preemption``): the step in flight finishes, every rank
    agrees at its end, the Trainer saves a checkpoint there (``save``) and stops; the script then
    ends normally (exit 0)."""

    def __init__(self, preemption, *, save: bool = True):
        self.preemption, self.save, self.stopped_at = preemption, save, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.preemption.device = args.device  # the flag's all-reduce runs where the backend can (NCCL: the GPU)
        self.preemption.install()

    def on_step_end(self, args, state, control, **kwargs):
        if self.preemption.stop_now():
            self.stopped_at = state.global_step
            control.should_save = self.save
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.preemption.uninstall()


def _finished(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, transformers.trainer.TRAINER_STATE_NAME)):
        return False
    try:
        return os.path.isfile(os.path.join(_engine_checkpoint(path), MANIFEST))
    except CheckpointError:
        return False


def _engine_checkpoint(path: str) -> str:
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{latest} is missing: {path} holds no engine checkpoint")
    return os.path.join(path, resolve_tag(path, read_text(latest).strip()))
