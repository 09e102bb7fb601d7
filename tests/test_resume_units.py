"""The single-process parts of save/resume/preemption: the resumable data stream, pruning, the
failure-injection spec, the example flags and the preemption handler (no ranks)."""
import argparse
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from ds_fssdp.data.sampler import WindowSampler
from ds_fssdp.runtime import faults, resume_cli
from ds_fssdp.runtime.preempt import EXIT_GRACE_EXPIRED, Preemption
from ds_fssdp.runtime.resume import prune

# Two tests start a Python process (the preemption handler's exit, the example's flag check).
pytestmark = pytest.mark.distributed

CORPUS_N = torch.arange(10_000, dtype=torch.int64) % 251


def test_sampler_continues_at_the_exact_next_sample_on_any_world_size():
    """4 ranks for 3 steps, saved and loaded into a sampler on 2 ranks: the samples, in global
    order, are the one stream a single rank would draw (none twice, none skipped)."""
    def drawn(sampler, steps, world, micro):
        out = []
        for _ in range(steps):
            start = sampler.position
            for r in range(world):  # one process plays every rank: each starts from the same position
                sampler.position = start
                out.append(sampler.next_batch(micro, rank=r, world=world)[0])
        return torch.cat(out)

    four = WindowSampler(CORPUS_N, 16, seed=5)
    first = drawn(four, 3, 4, 2)
    two = WindowSampler(CORPUS_N, 16, seed=5)
    two.load_state_dict(four.state_dict())
    assert two.position == 3 * 4 * 2
    second = drawn(two, 5, 2, 2)
    one = WindowSampler(CORPUS_N, 16, seed=5)
    assert torch.equal(torch.cat([first, second]), drawn(one, 44, 1, 1))
    x, y = WindowSampler(CORPUS_N, 16, seed=5).next_batch(3, rank=0, world=1)
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match=r"saved sampler's seed \(6\) differs from this run's \(5\)"):
        two.load_state_dict(dict(four.state_dict(), seed=6))


def _checkpoint(root, name, complete=True):
    os.makedirs(os.path.join(root, name))
    if complete:
        open(os.path.join(root, name, "manifest.json"), "w").close()


def test_prune_keeps_the_newest_complete_and_latest_and_in_flight_saves(tmp_path):
    root = str(tmp_path)
    for step in (3, 6, 9, 12):
        _checkpoint(root, f"global_step{step}")
    for name in (".universal-global_step3", ".tmp-global_step4", ".tmp-global_step15", ".pruned-global_step1"):
        _checkpoint(root, name, complete=False)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step6")  # e.g. the newer ones were saved with save_latest=False: latest is kept too
    removed = prune(root, keep_last=2)
    assert removed == ["global_step3"]
    assert sorted(os.listdir(root)) == [".tmp-global_step15", "global_step12", "global_step6",
                                        "global_step9", "latest"]


def test_fault_specs_parse_or_name_the_bad_entry():
    assert faults.parse("2:7:backward; 0:10:save:term:1") == [
        faults.Fault(2, 7, "backward"), faults.Fault(0, 10, "save", "term", 1)]
    assert faults.parse("") == []
    for bad, why in [("1:2", "expected rank:step:phase"), ("1:2:lunch", "phase must be one of"),
                     ("1:2:gate:explode", "action must be one of"), ("a:2:gate", "invalid literal")]:
        with pytest.raises(ValueError, match=rf"FSSDP_FAULTS entry '{bad}': {why}"):
            faults.parse(bad)


@pytest.mark.parametrize("argv,message", [
    (["--save-interval", "-1", "--save-dir", "d"], r"--save-interval \(-1\) must be >= 0"),
    (["--keep-last", "0", "--save-dir", "d"], r"--keep-last \(0\) must be >= 1"),
    (["--save-interval", "5"], "--save-interval, --keep-last and --async-save need --save-dir"),
    (["--async-save"], "--save-interval, --keep-last and --async-save need --save-dir"),
    (["--preempt-grace", "0"], r"--preempt-grace \(0.0\) must be > 0"),
    (["--resume", "newest"], "invalid choice: 'newest'"),
])
def test_example_flags_are_checked_by_name(argv, message, capsys):
    p = argparse.ArgumentParser()
    resume_cli.add_arguments(p)
    with pytest.raises(SystemExit):
        resume_cli.check_arguments(p, p.parse_args(argv))
    assert re.search(message, capsys.readouterr().err)


def test_preemption_records_signals_and_exits_when_the_grace_time_is_over():
    previous = signal.getsignal(signal.SIGUSR1)
    p = Preemption().install()
    try:
        assert not p.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert [s for s, _ in p.received] == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
    with pytest.raises(ValueError, match=r"grace_s \(0\) must be > 0"):
        Preemption(grace_s=0)
    code = ("import os, signal, time\nfrom ds_fssdp.runtime.preempt import Preemption\n"
            "Preemption(grace_s=0.5).install()\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_GRACE_EXPIRED, proc.stderr[-2000:]
    assert "grace time (0.5 s) is over" in proc.stderr


def _trainer_checkpoint(root, step, *, finished=True, payload=b"rows"):
    """A Trainer checkpoint-<step> holding an engine checkpoint with one file and its manifest."""
    from ds_fssdp.runtime.checkpoint import FORMAT, _digest
    path = os.path.join(root, f"checkpoint-{step}")
    tag_dir = os.path.join(path, f"global_step{step}")
    os.makedirs(os.path.join(tag_dir, "fssdp"))
    rows = os.path.join(tag_dir, "fssdp", "rank00000.pt")
    with open(rows, "wb") as f:
        f.write(payload)
    with open(os.path.join(tag_dir, "manifest.json"), "w") as f:
        json.dump({"format": FORMAT, "files": {"fssdp/rank00000.pt": _digest(rows)}}, f)
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(f"global_step{step}")
    if finished:
        open(os.path.join(path, "trainer_state.json"), "w").close()
    return rows


def test_hf_last_complete_checkpoint_skips_unfinished_and_names_corrupt(tmp_path):
    from ds_fssdp.integrations.hf_resume import last_complete_checkpoint
    from ds_fssdp.runtime.checkpoint import CheckpointError
    root = str(tmp_path)
    assert last_complete_checkpoint(os.path.join(root, "none")) is None
    _trainer_checkpoint(root, 4)
    _trainer_checkpoint(root, 12, finished=False)  # cut short before trainer_state.json: never resumed
    assert last_complete_checkpoint(root) == os.path.join(root, "checkpoint-4")
    bad = _trainer_checkpoint(root, 8)
    with open(bad, "r+b") as f:
        f.write(b"R")  # same size, other bytes
    with pytest.raises(CheckpointError, match=rf"newest checkpoint {root}/checkpoint-8 is not valid \(resume with "
                                              rf"latest-valid.*checkpoint file {bad} is corrupted"):
        last_complete_checkpoint(root)
    assert last_complete_checkpoint(root, which="latest-valid") == os.path.join(root, "checkpoint-4")


def test_main_job_rejects_unknown_flags_before_starting():
    """``--save-dir`` used to be accepted and ignored (unknown flags passed silently)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt_moe.py")
    proc = subprocess.run([sys.executable, script, "--save-dri", "ckpt", "--local_rank=0"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "unrecognized arguments: --save-dri ckpt" in proc.stderr, proc.stderr[-2000:]
