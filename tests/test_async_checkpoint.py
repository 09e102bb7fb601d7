"""Asynchronous checkpoints (``engine.save_checkpoint(..., async_save=True)``): the state staged at
the step boundary, written and committed in the background while training goes on.

Two launches of 2 gloo ranks: one whose ranks are killed during the background write, then one
that carries every other check (and loads what the killed save left behind)."""
import functools
import os
import signal
import threading
import time

import pytest
import torch

import distributed
import resume_world
from distributed import spawn
from training import ds_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}
# ZeRO 1 (DeepSpeed's partitioned optimizer files), AdamW (moments and Adam's step), an LR schedule,
# re-sharding (owners that moved) and predictor windows: everything a checkpoint carries.
CFG = ds_config(world=2, zero=1, gas=1, optimizer=ADAMW, scheduler=WARMUP,
                fssdp={"metrics_csv": None, "reshard_interval": 2})
N, M = 3, 2  # steps before the save, steps taken while it is written


def _engine(seed=0):
    import copy

    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    from training import MODEL
    torch.manual_seed(seed)
    model = GPTMoE(MODEL)
    engine, *_ = ds_fssdp.initialize(model=model, config=copy.deepcopy(CFG))
    return engine, model


def _state(engine, model, *, moments=True) -> dict:
    """Everything a resume restores (collective). DeepSpeed links ZeRO's optimizer fragments only at
    the first step after a load, so a state taken right after one leaves the dense moments out;
    the exact steps that follow check them."""
    from deepspeed.utils import safe_get_full_fp32_param
    from toy import expert_rows
    if moments:
        out = resume_world.full_state(engine, model)
    else:
        out = dict(dense={n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()},
                   rows=expert_rows(engine),
                   experts=[{k: v.float() for k, v in l.export_experts().items()} for l in model.moe_layers()],
                   global_steps=engine.global_steps, stage_steps=engine.fssdp.steps, lr=engine.get_lr())
    out.update(owners=[s.owner_E.clone() for s in engine.fssdp.shards], predictor=engine.fssdp.predictor.state_dict(),
               windows=list(engine.fssdp.window_s), attentions=list(engine.fssdp.attention_s),
               rng=torch.get_rng_state())
    return out


def _without_moments(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "moments"}


def _listing(save_dir) -> tuple:
    """``latest`` and the directory's entries (less the scripts DeepSpeed copies beside checkpoints)."""
    latest = os.path.join(save_dir, "latest")
    return ((open(latest).read() if os.path.exists(latest) else None),
            sorted(n for n in os.listdir(save_dir) if not n.endswith(".py")))


def _differences(a, b, where="") -> list:
    """Where two loaded checkpoint files differ: tensors bitwise (dtype, shape, values), the rest by ==."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if type(a) is type(b) and hasattr(a, "__dict__") and not callable(a):  # DeepSpeed's loss scaler, dataclasses
        return _differences(vars(a), vars(b), f"{where}.{type(a).__name__}")
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _compare(sync_root, async_root) -> dict:
    """Every file of both checkpoints, loaded with the safe reader: what differs besides the tag."""
    import json

    from ds_fssdp.runtime.checkpoint import MANIFEST, load_file
    manifests = [json.load(open(os.path.join(r, MANIFEST))) for r in (sync_root, async_root)]
    out = {"names": [sorted(m["files"]) for m in manifests], "diffs": {}, "same_sha256": []}
    for name in manifests[0]["files"]:
        if name.endswith(".json"):
            a, b = (json.load(open(os.path.join(r, name))) for r in (sync_root, async_root))
            a.pop("tag"), b.pop("tag")
        else:
            a, b = (load_file(os.path.join(r, name)) for r in (sync_root, async_root))
        out["diffs"][name] = _differences(a, b)
        if manifests[0]["files"][name] == manifests[1]["files"].get(name):
            out["same_sha256"].append(name)
    return out


# -- the launch whose ranks are killed during the background write --------------------------------
def _killed_worker(rank, world, save_dir):
    from ds_fssdp.runtime.checkpoint import background
    engine, model = _engine()
    resume_world.train(engine, rank, N, 0)
    engine.save_checkpoint(save_dir, tag="before")
    torch.save(_state(engine, model), os.path.join(save_dir, f"state{rank}.pt"))
    resume_world.train(engine, rank, 1, N)
    real = background.write_file

    def killing(path, data):
        real(path, data)  # one file on disk, the others not: rank 1 dies in the middle of its write
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    background.write_file = killing
    engine.save_checkpoint(save_dir, tag="killed", async_save=True)
    open(os.path.join(save_dir, f"saving{rank}"), "w").close()
    time.sleep(600)  # rank 0 waits for rank 1's files until the test kills it too (as a launcher does)


def _launch_killed(save_dir) -> list:
    """Both ranks die by SIGKILL: rank 1 during its write, rank 0 (killed by the test, as torchrun
    stops the survivors) while it waits to commit. Returns the exit codes."""
    port = distributed.free_port()
    procs = [distributed.rank_process(r, 2, port, _killed_worker, (save_dir, ), save_dir) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(timeout=240)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(save_dir, "saving0")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # rank 0's thread has written its files and waits for rank 1's
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    return [p.exitcode for p in procs]


# -- the launch that carries every other check ---------------------------------------------------
def _worker(rank, world, root, killed_dir):
    from ds_fssdp.runtime.checkpoint import CheckpointError, background
    real = background.write_file
    out = {}
    save_dir = os.path.join(root, "main")
    engine, model = _engine()
    resume_world.train(engine, rank, N, 0)
    engine.save_checkpoint(save_dir, tag="sync", client_state={"data": {"position": N}})
    out["saved"] = _state(engine, model)

    # The same state saved asynchronously; its writes are held until training has gone on M steps.
    gate = threading.Event()

    def held(path, data):
        gate.wait()
        real(path, data)

    background.write_file = held
    client = {"data": {"position": N}}
    engine.save_checkpoint(save_dir, tag="async", client_state=client, async_save=True)
    client["data"]["position"] = -1  # the user's dict changes after the call: the staged copy must not
    out["cont"] = resume_world.train(engine, rank, M, N)
    out["during"] = dict(pending=engine.fssdp_checkpoint_writer.pending, listing=_listing(save_dir))
    gate.set()
    engine.wait_for_checkpoint()
    out["after"] = _listing(save_dir)
    out["final"] = _state(engine, model)
    out["compare"] = _compare(os.path.join(save_dir, "sync"), os.path.join(save_dir, "async")) if rank == 0 else None

    # A fresh engine (other initial weights) resumes from "latest", the asynchronous save.
    engine2, model2 = _engine(seed=1234)
    _, client_state = engine2.load_checkpoint(save_dir)
    out["client_state"] = client_state
    out["loaded"] = _state(engine2, model2, moments=False)
    out["resumed"] = resume_world.train(engine2, rank, M, N)
    out["resumed_final"] = _state(engine2, model2)
    engine2.fssdp.close()

    # A second save waits for the first.
    gate = threading.Event()
    background.write_file = held
    engine.save_checkpoint(save_dir, tag="first", async_save=True)
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    started = time.perf_counter()
    engine.save_checkpoint(save_dir, tag="second", async_save=True)
    out["second"] = dict(seconds=time.perf_counter() - started, first_committed=os.path.isdir(
        os.path.join(save_dir, "first")), first_pending=os.path.isdir(os.path.join(save_dir, ".tmp-first")))
    engine.wait_for_checkpoint()
    out["after_second"] = _listing(save_dir)

    # An error in the background write surfaces on every rank: at the wait, or at the next save.
    def broken(path, data):
        if rank == 1 and path.endswith(".pt"):
            raise OSError(28, "No space left on device (injected)")
        real(path, data)

    background.write_file = broken
    errors = {}
    engine.save_checkpoint(save_dir, tag="broken", async_save=True)
    resume_world.train(engine, rank, 1, N + M)
    with pytest.raises(CheckpointError) as err:
        engine.wait_for_checkpoint()
    errors["wait"] = (str(err.value), _listing(save_dir))
    engine.save_checkpoint(save_dir, tag="broken", async_save=True)
    background.write_file = real
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(save_dir, tag="next")
    errors["next_save"] = (str(err.value), _listing(save_dir))
    engine.save_checkpoint(save_dir, tag="next", async_save=True)  # the error was raised once; saving works again
    engine.wait_for_checkpoint()
    errors["recovered"] = _listing(save_dir)
    out["errors"] = errors

    # What the killed launch left: "latest" is the save before, complete and loadable.
    out["killed_listing"] = _listing(killed_dir)
    engine3, model3 = _engine(seed=99)
    engine3.load_checkpoint(killed_dir)
    out["killed_loaded"] = _state(engine3, model3, moments=False)
    out["killed_saved"] = torch.load(os.path.join(killed_dir, f"state{rank}.pt"), weights_only=False)
    engine3.save_checkpoint(killed_dir, tag="killed", async_save=True)  # the tag's leftovers are replaced
    engine3.wait_for_checkpoint()
    out["killed_resaved"] = _listing(killed_dir)
    engine3.fssdp.close()

    # Exit waits for a pending write: this one is still being written when the worker returns.
    def slow(path, data):
        time.sleep(0.2)
        real(path, data)

    background.write_file = slow
    engine.save_checkpoint(os.path.join(root, "exit"), tag="at-exit", async_save=True)
    out["exit_pending"] = engine.fssdp_checkpoint_writer.pending
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("killed"))
    return save_dir, _launch_killed(save_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory, killed):
    root = str(tmp_path_factory.mktemp("async"))
    return root, spawn(2, _worker, root, killed[0])


def _assert_same(a, b, what):
    diffs = _differences(a, b, what)
    assert not diffs, diffs[:5]


def test_async_save_equals_sync_save_bitwise(results):
    """Saved at the same step, one synchronously and one in the background while M more steps ran:
    every file holds the same tensors, bitwise (ours even byte for byte)."""
    _, ranks = results
    cmp = ranks[0]["compare"]
    assert cmp["names"][0] == cmp["names"][1] and len(cmp["names"][0]) >= 6
    assert {n: d for n, d in cmp["diffs"].items() if d} == {}
    assert {"fssdp/rank00000.pt", "fssdp/rank00001.pt", "fssdp/common.pt"} <= set(cmp["same_sha256"])


def test_training_goes_on_during_the_write(results):
    for r in results[1]:
        latest, names = r["during"]["listing"]
        assert r["during"]["pending"] and latest == "sync" and ".tmp-async" in names and "async" not in names
        latest, names = r["after"]
        assert latest == "async" and "async" in names and ".tmp-async" not in names
        assert r["final"]["global_steps"] == N + M


def test_resume_from_async_save_is_exact(results):
    """The state loaded from the asynchronous save is the state at the save, bitwise, on every
    rank, and training on from it repeats the steps taken during the write exactly."""
    for rank, r in enumerate(results[1]):
        _assert_same(r["loaded"], _without_moments(r["saved"]), f"rank {rank}: loaded")
        assert r["resumed"] == r["cont"], rank
        _assert_same(r["resumed_final"], r["final"], f"rank {rank}: final")
        assert r["client_state"]["data"] == {"position": N}, r["client_state"]


def test_second_save_waits_for_the_first(results):
    for r in results[1]:
        s = r["second"]
        assert s["first_committed"] and not s["first_pending"] and s["seconds"] > 0.4, s
        assert r["after_second"][0] == "second"


def test_background_error_surfaces_on_every_rank(results):
    for rank, r in enumerate(results[1]):
        e = r["errors"]
        for when in ("wait", "next_save"):
            message, (latest, names) = e[when]
            assert "No space left on device (injected)" in message and "rank(s) [0, 1]" in message, (rank, message)
            assert latest == "second" and "broken" not in names, (rank, when, names)
        latest, names = e["recovered"]
        assert latest == "next" and "next" in names and ".tmp-next" not in names


def test_kill_during_background_write_keeps_previous_checkpoint(killed, results):
    save_dir, codes = killed
    assert codes == [-signal.SIGKILL, -signal.SIGKILL], codes
    for rank, r in enumerate(results[1]):
        latest, names = r["killed_listing"]
        assert latest == "before" and ".tmp-killed" in names and "killed" not in names, names
        _assert_same(r["killed_loaded"], _without_moments(r["killed_saved"]), f"rank {rank}: loaded after the kill")
        latest, names = r["killed_resaved"]
        assert latest == "killed" and ".tmp-killed" not in names


def test_exit_waits_for_the_pending_write(results):
    from ds_fssdp.runtime.checkpoint import read_manifest, verify_files
    root, ranks = results
    assert all(r["exit_pending"] for r in ranks)
    save_dir = os.path.join(root, "exit")
    assert _listing(save_dir) == ("at-exit", ["at-exit", "latest"])
    verify_files(os.path.join(save_dir, "at-exit"), read_manifest(os.path.join(save_dir, "at-exit")))


# -- the writer alone, in this process ------------------------------------------------------------
def _job(tmp_path, *, world, files, timeout_s=60.0):
    from ds_fssdp.runtime.checkpoint import background
    from ds_fssdp.runtime.checkpoint.save import commit_files
    save_dir = str(tmp_path)
    tmp_dir = os.path.join(save_dir, ".tmp-t")
    os.makedirs(tmp_dir)
    commit = functools.partial(commit_files, save_dir, "t", tmp_dir, save_latest=True)
    return background.Job(tag="t", tmp_dir=tmp_dir, rank=0, world=world, timeout_s=timeout_s, commit=commit,
                          files=files)


def _write_text(text, path):
    with open(path, "w") as f:
        f.write(text)


def test_rank_zero_does_not_commit_without_every_report(tmp_path):
    """Rank 1 never reports (killed): rank 0 gives up after the timeout, naming the rank."""
    from ds_fssdp.runtime.checkpoint import CheckpointError, background
    job = _job(tmp_path, world=2, files={"a.txt": functools.partial(_write_text, "a")}, timeout_s=0.3)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] did not finish writing"):
        background.run(job)
    assert sorted(os.listdir(tmp_path)) == [".tmp-t"]


def test_failure_at_exit_is_logged(tmp_path, monkeypatch):
    """Nobody waited: the exit handler waits for the write and logs its error."""
    from ds_fssdp.runtime.checkpoint import background

    def full(path):
        raise OSError(28, "No space left on device (injected)")

    logged = []
    monkeypatch.setattr(background.logger, "error", logged.append)
    writer = background.BackgroundWriter()
    writer.start(_job(tmp_path, world=1, files={"a.pt": full}))
    writer._at_exit()
    assert len(logged) == 1 and "'t' failed" in logged[0] and "No space left on device" in logged[0], logged
    assert writer.join() == (None, None)  # reported once


def test_single_rank_commit_lists_every_file(tmp_path):
    from ds_fssdp.runtime.checkpoint import background, read_manifest, verify_files
    job = _job(tmp_path, world=1, files={"a.txt": functools.partial(_write_text, "a"),
                                         "sub/b.txt": functools.partial(_write_text, "b")})
    os.makedirs(os.path.join(job.tmp_dir, "sub"))
    _write_text("c", os.path.join(job.tmp_dir, "c.txt"))  # written outside the staged files: hashed too
    background.run(job)
    root = os.path.join(str(tmp_path), "t")
    assert sorted(read_manifest(root)["files"]) == ["a.txt", "c.txt", "sub/b.txt"]
    verify_files(root, read_manifest(root))
    assert open(os.path.join(str(tmp_path), "latest")).read() == "t"


def test_async_save_flag_is_checked_before_any_collective():
    from ds_fssdp.runtime.checkpoint import save
    with pytest.raises(ValueError, match=r"async_save must be True or False, got 'yes'"):
        save(None, "some/dir", "t", async_save="yes", ds_save=None)
