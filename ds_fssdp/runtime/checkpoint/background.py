"""The background half of an asynchronous save: write the staged files, then commit them
atomically (manifest, rename, ``latest`` last) while training goes on (docs/robustness.md, "Saves
that don't stop training").

Every rank's thread writes its staged states into ``.tmp-<tag>`` (flushed, hashed) and reports its
digests, or its error, under ``.tmp-<tag>/.written/``; rank 0's thread waits for every report (at
most the collective timeout) and commits as a synchronous save does. The ranks agree through the
shared filesystem: a collective from a second thread could interleave with the training's own, and
a separate group would break when the job tears its groups down with a write pending. ``wait``
(every rank) joins the thread and raises any rank's error on every rank; at exit a pending write is
waited for and its error logged.

Not DeepSpeed's decoupled writer (read for 0.19.8: it needs FastPersist's ``async_io``, not buildable
on a CPU machine, waits at the next step, moves ``latest`` with a plain write and knows none of our
files; its extension point is what ``staging.py`` uses), nor torch DCP's ``async_save`` (its own
format, tensors and plain leaves only, a collective from the thread).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint.collective import agree
from ds_fssdp.runtime.checkpoint.files import CheckpointError, atomic_write_text, digest, read_json, walk

WRITTEN = ".written"  # inside .tmp-<tag>: one report per rank, removed before the commit
POLL_S = 0.02


@dataclass
class Job:
    """One rank's part of an asynchronous save. ``files``: path relative to ``tmp_dir`` -> a
    function writing the staged state to the path it is given; ``commit(digests)``: rank 0's
    commit (manifest, renames, ``latest``)."""
    tag: str
    tmp_dir: str
    rank: int
    world: int
    timeout_s: float
    commit: Callable[[dict], None]
    files: dict = field(repr=False)


def write_file(path: str, write: Callable[[str], None]) -> None:
    """Looked up on the module at call time, so that tests can wrap it (delays, kills, errors)."""
    write(path)


def report_path(tmp_dir: str, rank: int) -> str:
    return os.path.join(tmp_dir, WRITTEN, f"rank{rank:05d}.json")


def run(job: Job) -> None:
    """The thread's work on one rank; raises this rank's error (rank 0: also the commit's)."""
    written, err = {}, None
    try:
        for name, write in job.files.items():
            path = os.path.join(job.tmp_dir, name)
            try:
                sys.modules[__name__].write_file(path, write)
                written[name] = digest(path)  # flushed to disk too
            except Exception as e:  # a full disk, an unpicklable client_state: named with the file
                raise CheckpointError(f"writing checkpoint file {path} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # reported to rank 0, then raised here
        err = e
    job.files = {}  # the staged states are no longer needed
    path = report_path(job.tmp_dir, job.rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps({"files": written} if err is None else  # rank 0 never reads half a report
                                       {"error": f"{type(err).__name__}: {err}"}))
    if err is not None:
        raise err
    if job.rank == 0:
        job.commit(_digests(job))


def _digests(job: Job) -> dict:
    """Every rank's digests once all reported; a file in ``.tmp-<tag>`` that no rank staged (one
    DeepSpeed wrote directly) is hashed here, so the manifest covers the directory as a
    synchronous save's does."""
    deadline = time.monotonic() + job.timeout_s
    missing = list(range(job.world))
    while True:
        missing = [r for r in missing if not os.path.isfile(report_path(job.tmp_dir, r))]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint {job.tag!r}: rank(s) {missing} did not finish writing into "
                                  f"{job.tmp_dir} within {job.timeout_s:.0f} s; not committed")
        time.sleep(POLL_S)
    digests, failed = {}, {}
    for r in range(job.world):
        body = read_json(report_path(job.tmp_dir, r))
        if "error" in body:
            failed[r] = body["error"]
        else:
            digests.update(body["files"])
    if failed:
        raise CheckpointError(f"checkpoint {job.tag!r} not committed: writing failed on rank(s) {sorted(failed)}: "
                              + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))
    shutil.rmtree(os.path.join(job.tmp_dir, WRITTEN))
    digests.update({name: digest(os.path.join(job.tmp_dir, name)) for name in walk(job.tmp_dir) if name not in digests})
    return digests


class BackgroundWriter:
    """One engine's background save: at most one at a time."""

    def __init__(self):
        self._thread = self._tag = self._error = None
        self.last_seconds = None  # how long this rank's last background write (and commit) took
        atexit.register(self._at_exit)

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Job) -> None:
        assert self._thread is None, "a save must wait for the one before it"
        self._tag, self._error = job.tag, None
        self._thread = threading.Thread(target=self._run, args=(job, ), name=f"fssdp-checkpoint-{job.tag}")
        self._thread.start()

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            run(job)
        except BaseException as err:  # raised on every rank by wait, logged at exit
            self._error = err
            return
        finally:
            self.last_seconds = time.perf_counter() - started
        if job.rank == 0:
            logger.info(f"fssdp: checkpoint {job.tag!r} written and committed in the background "
                        f"({self.last_seconds:.2f} s)")

    def join(self) -> tuple:
        """Wait for this rank's thread; return (tag, error) and forget them. (None, None) if idle."""
        if self._thread is None:
            return None, None
        self._thread.join()
        out = (self._tag, self._error)
        self._thread, self._tag, self._error = None, None, None
        return out

    def _at_exit(self) -> None:
        if self._thread is None:
            return
        if self.pending:
            logger.info(f"fssdp: waiting for the background write of checkpoint {self._tag!r} before exiting")
        tag, err = self.join()
        if err is not None:
            logger.error(f"fssdp: the background write of checkpoint {tag!r} failed: {type(err).__name__}: {err}")


def wait(writer) -> None:
    """Collective: block until the pending asynchronous save (if any) is committed; raise its error,
    from whichever rank, on every rank."""
    tag, err = writer.join() if writer is not None else (None, None)
    agree(f"the background write of checkpoint {tag!r}", err)
