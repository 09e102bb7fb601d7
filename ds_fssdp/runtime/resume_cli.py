"""The command-line flags of a restartable training script (both examples use them):
``--save-dir``, ``--save-interval``, ``--keep-last``, ``--async-save``, ``--resume``, ``--preempt-grace``,
``--no-preempt-handler``."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-dir", default=None, help="checkpoint directory: resume from it, save into it")
    p.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--keep-last", type=int, default=None, help="keep only the K newest checkpoints")
    p.add_argument("--async-save", action="store_true",
                   help="write the interval checkpoints in the background (the last and a preemption's are synchronous)")
    p.add_argument("--resume", choices=("latest", "latest-valid", "none"), default="latest",
                   help="latest: the newest complete checkpoint, stop if it is corrupt; latest-valid: fall back to the "
                   "newest valid one; none: start from step 0")
    p.add_argument("--preempt-grace", type=float, default=None, help="seconds a preempted job has to save and exit")
    p.add_argument("--no-preempt-handler", action="store_true", help="SIGTERM/SIGUSR1 kill at once (no save)")


def check_arguments(p: argparse.ArgumentParser, args) -> None:
    """Reject inconsistent values by name (``p.error``: usage and exit 2, before anything starts)."""
    if args.save_interval < 0:
        p.error(f"--save-interval ({args.save_interval}) must be >= 0")
    if args.keep_last is not None and args.keep_last < 1:
        p.error(f"--keep-last ({args.keep_last}) must be >= 1")
    if args.preempt_grace is not None and not args.preempt_grace > 0:
        p.error(f"--preempt-grace ({args.preempt_grace}) must be > 0")
    if (args.save_interval or args.keep_last or args.async_save) and not args.save_dir:
        p.error("--save-interval, --keep-last and --async-save need --save-dir")
