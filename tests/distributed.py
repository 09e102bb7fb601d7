"""Spawn gloo CPU ranks that run one function and return its results to the test.

Ranks are forked from a fork server that has imported torch and deepspeed once (importing them
takes several seconds per process, over a second of a 2-core machine per rank), and what every
engine's optimizer set-up imports (``PRELOAD``). A rank starts as
a spawned one would: the test process's environment, working directory and ``sys.path`` at the
call (not the server's, which started with the first call), a fresh interpreter's ``random``
state. DeepSpeed's shared-memory inference all-reduce is never used in training; its first-use JIT
build (about a minute) is skipped in the ranks.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed
import torch.multiprocessing as mp

# torch._dynamo and DeepSpeed's Muon module: every engine's optimizer set-up imports them (torch's
# Optimizer, DeepSpeed's ZeRO optimizer check, which compiles Muon's kernels), 3-4 s per rank.
# The fork server skips a module that fails to import.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "deepspeed", "deepspeed.comm.torch",
           "deepspeed.runtime.zero.muon.muon_optimizer", "distributed"]
multiprocessing.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world_size: int, fn, *args, local_size: int | None = None, fresh: bool = False, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return each
    rank's result (in rank order). An exception on any rank fails the call with its traceback.
    ``fresh``: spawned interpreters instead of the fork server's, for a test whose environment must
    be read at a module's import (``PRELOAD`` imports triton, through torch._dynamo).

    A rank killed by a signal (a native abort, no Python exception; seen once in three full runs
    of the suite, before each rank destroyed its process group at the end) gets the launch retried
    once, on a new port, with a warning; a second death fails the test."""
    for attempt in range(2):
        try:
            return _spawn_once(world_size, fn, args, kwargs, local_size, "spawn" if fresh else "forkserver")
        except mp.ProcessExitedException as err:
            if attempt or err.signal_name is None:
                raise
            print(f"distributed.spawn: {err}; launching {getattr(fn, '__name__', fn)} again", file=sys.stderr)


def _spawn_once(world_size, fn, args, kwargs, local_size, start_method) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        try:
            mp.start_processes(_entry, args=(world_size, port, local_size, fn, args, kwargs, tmp, caller_state()),
                               nprocs=world_size, join=True, start_method=start_method)
        except mp.ProcessExitedException as err:
            # Killed by a signal after every rank had written its result (gloo's abort at exit): the
            # work is done, and running it again would repeat it in the test's own directories.
            if err.signal_name is None or not all(map(os.path.exists, paths)):
                raise
            print(f"distributed.spawn: {err} after every rank returned; keeping the results", file=sys.stderr)
        return [torch.load(path, weights_only=False) for path in paths]


def caller_state() -> tuple:
    """What a spawned rank would inherit from the caller: environment, working directory, sys.path."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def rank_process(rank: int, world_size: int, port: int, fn, args: tuple, tmp: str):
    """One rank of :func:`spawn` as an unstarted process, for a test that starts, waits for or kills
    ranks itself; ``fn(rank, world_size, *args)``'s result goes to ``tmp``."""
    ctx = multiprocessing.get_context("forkserver")
    return ctx.Process(target=_entry, args=(rank, world_size, port, None, fn, args, {}, tmp, caller_state()))


def _entry(rank, world_size, port, local_size, fn, args, kwargs, tmp, state):
    environ, cwd, path = state
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    random.seed()  # forked: reseed from the OS, as a fresh interpreter does
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % (local_size or world_size)),
        "LOCAL_SIZE": str(local_size or world_size),
        "OMP_NUM_THREADS": "1",
    })
    torch.set_num_threads(1)
    init_gloo()
    try:
        result = fn(rank, world_size, *args, **kwargs)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    path = os.path.join(tmp, f"rank{rank}.pt")
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)  # complete or absent: a rank killed while saving leaves none
    # Without it a gloo worker thread can free a finished work's tensors while the interpreter
    # shuts down and abort the rank ("terminate called without an active exception"; docs/robustness.md).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def init_gloo() -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
