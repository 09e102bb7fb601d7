"""Bad disks, on 2 gloo ranks: a save that hits a full disk (a size-limited writer: RLIMIT_FSIZE,
so the kernel refuses the write, whichever code writes) fails on every rank with the file named,
leaves the previous checkpoint the latest and loadable, and training continues and saves again;
a corrupted newest checkpoint is reported by name, and resume falls back to an older one only
with ``which="latest-valid"``."""
import os
import resource
import signal

import pytest
import torch

from distributed import spawn
from toy import expert_rows, toy_batch, toy_config, toy_engine

pytestmark = pytest.mark.distributed

LIMIT = 256  # bytes: every checkpoint file is larger


def _step(engine, step, rank):
    x, y = toy_batch(step, 0, rank)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_on_full_disk(engine, save_dir, step, *, full_rank):
    import ds_fssdp
    from ds_fssdp.runtime.checkpoint import CheckpointError
    from deepspeed import comm as dist
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    if dist.get_rank() == full_rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        ds_fssdp.save_step(engine, save_dir, step, keep_last=2)
        return None
    except CheckpointError as err:
        return str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def disk_worker(rank, world, save_dir):
    import ds_fssdp
    from deepspeed import comm as dist
    from ds_fssdp.runtime.checkpoint import CheckpointError

    engine, _ = toy_engine(toy_config(world=world, gas=1), dict(num_experts=4, k=2))
    out = {"losses": [_step(engine, 0, rank)]}
    ds_fssdp.save_step(engine, save_dir, 1, keep_last=2)
    at_1 = expert_rows(engine)
    out["losses"].append(_step(engine, 1, rank))
    # Rank 1's disk is full: its expert file fails. Then rank 0's: DeepSpeed's own file fails.
    out["ours_full"] = _save_on_full_disk(engine, save_dir, 2, full_rank=1)
    out["deepspeed_full"] = _save_on_full_disk(engine, save_dir, 2, full_rank=0)
    with open(os.path.join(save_dir, "latest")) as f:
        out["latest_after_full"] = f.read().strip()
    out["listing_after_full"] = sorted(os.listdir(save_dir))
    out["losses"].append(_step(engine, 2, rank))  # training goes on
    ds_fssdp.save_step(engine, save_dir, 3, keep_last=2)  # space again: saves
    out["listing"] = sorted(os.listdir(save_dir))
    dist.barrier()
    bad = os.path.join(save_dir, "global_step3", "fssdp", "rank00000.pt")
    if rank == 0:
        with open(bad, "r+b") as f:  # one flipped byte, size unchanged: only the digest can tell
            f.seek(os.path.getsize(bad) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        ds_fssdp.resume(engine, save_dir)
        out["corrupt"] = None
    except CheckpointError as err:
        out["corrupt"] = str(err)
    out["resumed"] = ds_fssdp.resume(engine, save_dir, which="latest-valid")
    loaded = expert_rows(engine)
    out["rows_equal"] = all(torch.equal(loaded[k][n], v) if torch.is_tensor(v) else loaded[k][n] == v
                            for k, row in at_1.items() for n, v in row.items())
    out["replayed_loss"] = _step(engine, 1, rank)  # step 2 again, from the state after step 1
    out["bad"] = bad
    return out


def test_full_disk_fails_every_rank_by_name_and_corrupt_newest_needs_latest_valid(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = spawn(2, disk_worker, save_dir)
    tmp2 = os.path.join(save_dir, ".tmp-global_step2")
    for rank, r in enumerate(results):
        # Both ranks raise (no rank left waiting), naming the file that could not be written.
        assert r["ours_full"] and "failed on rank(s) [1]" in r["ours_full"], r["ours_full"]
        assert f"writing checkpoint file {tmp2}/fssdp/rank00001.pt failed" in r["ours_full"]
        assert f"may write files of at most {LIMIT} bytes (RLIMIT_FSIZE)" in r["ours_full"]
        assert r["deepspeed_full"] and "failed on rank(s) [0]" in r["deepspeed_full"], r["deepspeed_full"]
        assert f"writing checkpoint file {tmp2}/mp_rank_00_model_states.pt failed" in r["deepspeed_full"]
        assert r["latest_after_full"] == "global_step1"
        assert "global_step2" not in r["listing_after_full"] and ".tmp-global_step2" not in r["listing_after_full"]
        assert [n for n in r["listing"] if n.startswith(("global", ".tmp"))] == ["global_step1", "global_step3"]
        # The corrupted newest checkpoint stops a plain resume, by name ...
        assert r["corrupt"] and f"newest checkpoint {save_dir}/global_step3 is not valid" in r["corrupt"]
        assert f"checkpoint file {r['bad']} is corrupted" in r["corrupt"] and "latest-valid" in r["corrupt"]
        # ... and latest-valid loads the one before it, exactly.
        assert r["resumed"] == 1 and r["rows_equal"]
        assert r["replayed_loss"] == r["losses"][1], rank
