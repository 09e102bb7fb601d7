"""Nothing lost when ranks fail: the main job (examples/train_gpt_moe.py, tiny model, 4 gloo CPU
ranks under plain ``torchrun``) killed, restarted and preempted ends bitwise where the
uninterrupted run ends (every step's loss, the final weights), and never loads a partial
checkpoint; a checkpoint saved on 4 ranks loads on 2 exactly.

One uninterrupted reference run (module fixture) serves every test. Failures come from the
``FSSDP_FAULTS`` hook (ds_fssdp/runtime/faults.py), keyed by (rank, step, phase, attempt).
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

from distributed import free_port, spawn

from ds_fssdp.runtime.checkpoint import consolidated_state_dict, load_file, read_manifest, verify_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, STEPS, INTERVAL = 4, 16, 3
TINY = ["--steps", str(STEPS), "--seq-len", "32", "--d-model", "32", "--layers", "2", "--ffn-hidden", "64",
        "--no-report", "--save-interval", str(INTERVAL)]
MID_STEP = ("forward", "gate", "exchange", "backward", "step")


def torchrun(tmp, name, *, world=WORLD, restarts=0, faults="", extra=()):
    """The main job as a user types it: ``torchrun --max-restarts N examples/train_gpt_moe.py``."""
    run = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--max-restarts",
           str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           os.path.join(REPO, "examples", "train_gpt_moe.py"), *TINY, "--save-dir", os.path.join(run, "ckpt"),
           "--out", run, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", FSSDP_FAULTS=faults)
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    with open(os.path.join(tmp, name + ".log"), "w") as f:
        f.write(log)
    return proc.returncode, log, run


def losses(run):
    with open(os.path.join(run, "losses.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_weights(run, step=STEPS):
    return consolidated_state_dict(os.path.join(run, "ckpt"), tag=f"global_step{step}")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reference"))
    rc, log, run = torchrun(tmp, "reference")
    assert rc == 0, log[-4000:]
    ref = losses(run)
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    return {"run": run, "losses": ref, "weights": final_weights(run)}


def chaos_schedule(seed=26):
    """Five SIGKILLs at increasing steps (each fires in the next attempt): one in the middle of a
    save, the others inside a step, each at a random phase and rank."""
    rng = random.Random(seed)
    saves = [s for s in range(INTERVAL, STEPS, INTERVAL)]
    save_step = rng.choice(saves)
    steps = sorted(rng.sample([s for s in range(1, STEPS) if s != save_step], 4) + [save_step])
    phases = ["save" if s == save_step else rng.choice(MID_STEP) for s in steps]
    if not any(p in ("gate", "exchange", "backward") for p in phases):  # at least one inside the MoE step
        phases[next(i for i, p in enumerate(phases) if p != "save")] = "exchange"
    return [(rng.randrange(WORLD), s, p, a) for a, (s, p) in enumerate(zip(steps, phases))]


def test_chaos_sigkills_under_torchrun_restarts_end_as_the_uninterrupted_run(reference, tmp_path):
    """Resume exactness at five different points of a 4-rank run (three or more distinct resume
    steps), restarts by plain torchrun: every step's loss and the final weights are bitwise the
    uninterrupted run's; each attempt resumed a complete checkpoint at or before its kill."""
    schedule = chaos_schedule()
    faults = ";".join(f"{r}:{s}:{p}:kill:{a}" for r, s, p, a in schedule)
    rc, log, run = torchrun(str(tmp_path), "chaos", restarts=len(schedule), faults=faults,
                            extra=["--keep-last", "2"])
    assert rc == 0, log[-6000:]
    fired = re.findall(r"fssdp faults: rank (\d+) kill at step (\d+), phase (\w+)", log)
    assert [(int(r), int(s), p) for r, s, p in fired] == [(r, s, p) for r, s, p, _ in schedule], (fired, schedule)
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+) from", log)]
    assert len(resumed) == len(schedule), resumed
    for (rank, kill, phase, _), start in zip(schedule, resumed):
        # The latest complete checkpoint: a save cut short at `kill` is not it.
        newest = kill if phase != "save" else kill - 1
        assert start == newest - newest % INTERVAL, (kill, phase, start)
    assert len(set(resumed)) >= 3
    assert losses(run) == reference["losses"]
    assert_same_weights(final_weights(run), reference["weights"])
    kept = sorted(d for d in os.listdir(os.path.join(run, "ckpt")) if d.startswith("global_step"))
    assert kept == [f"global_step{STEPS - STEPS % INTERVAL}", f"global_step{STEPS}"]  # --keep-last 2


def test_sigterm_to_one_rank_mid_step_saves_that_step_everywhere_and_resumes_exactly(reference, tmp_path):
    """Rank 2 gets SIGTERM inside step 8's backward, and again during the save: all four ranks
    finish step 8, agree, save global_step8 (complete, every rank's files) and exit 0; the job
    started again ends as the uninterrupted run. The interval saves of both starts are written in
    the background (--async-save): the preemption's save first commits the pending one."""
    stop = 7  # the engine's step counter: the 8th step
    rc, log, run = torchrun(str(tmp_path), "preempted", faults=f"2:{stop}:backward:term;2:{stop + 1}:save:term",
                            extra=["--async-save"])
    assert rc == 0, log[-4000:]
    assert f"preempted: stopped after step {stop + 1}" in log
    assert "SIGTERM received again; already stopping" in log
    ckpt = os.path.join(run, "ckpt")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == f"global_step{stop + 1}"
    root = os.path.join(ckpt, f"global_step{stop + 1}")
    verify_files(root, read_manifest(root))
    assert sorted(os.listdir(os.path.join(root, "fssdp"))) == ["common.pt", "meta.json"] + [
        f"rank{r:05d}.pt" for r in range(WORLD)]
    assert losses(run) == reference["losses"][:stop + 1]

    assert os.path.isdir(os.path.join(ckpt, f"global_step{stop - stop % INTERVAL}"))  # the background save
    rc, log, run = torchrun(str(tmp_path), "preempted", extra=["--async-save"])
    assert rc == 0, log[-4000:]
    assert f"resumed at step {stop + 1} from" in log
    assert losses(run) == reference["losses"]
    assert_same_weights(final_weights(run), reference["weights"])


def load_on_two(rank, world, save_dir, tag):
    """The main job's model and config on 2 ranks, resumed from the 4-rank checkpoint."""
    import ds_fssdp
    from ds_fssdp.data import load_corpus, split
    from ds_fssdp.data.sampler import WindowSampler
    from ds_fssdp.models import GPTMoE, GPTMoEConfig

    with open(os.path.join(REPO, "ds_configs", "gpt_moe_fssdp.json")) as f:
        config = json.load(f)
    torch.manual_seed(999)  # other initial weights: the checkpoint must bring them
    model = GPTMoE(GPTMoEConfig(seq_len=32, d_model=32, n_layers=2, num_experts=8, ffn_hidden=64))
    engine, _, _, _ = ds_fssdp.initialize(model=model, config=config)
    sampler = WindowSampler(split(load_corpus())[0], 32, seed=1234 + 1)  # the example's default --seed, + 1
    step = ds_fssdp.resume(engine, save_dir, state={"sampler": sampler})
    experts = [layer.export_experts() for layer in model.moe_layers()]  # collective
    state = {"step": step, "position": sampler.position, "global_steps": engine.global_steps, "experts": experts,
             "dense": {k: v.clone() for k, v in engine.module.state_dict().items()},
             "expert_optimizer": [engine.fssdp.expert_state.full_state(l) for l in range(len(model.moe_layers()))],
             "owned": [s.owned_E.clone() for s in engine.fssdp.shards]}
    engine.fssdp.close()
    return state


def test_four_rank_checkpoint_loads_on_two_ranks_exactly_also_after_a_kill_mid_conversion(reference, tmp_path):
    """World size 4 -> 2 (ZeRO 1: DeepSpeed's Universal Checkpoint underneath), first through the
    main job under torchrun with a SIGKILL inside the conversion, then loaded: the step, the data
    position, every weight and every expert's master and Adam moments equal the saved
    ones."""
    tag = f"global_step{2 * INTERVAL}"
    save_dir = str(tmp_path / "two" / "ckpt")
    shutil.copytree(os.path.join(reference["run"], "ckpt", tag), os.path.join(save_dir, tag))
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)
    # The main job on 2 ranks, rank 0 killed inside DeepSpeed's conversion: torchrun restarts it,
    # the half-written conversion is redone, the job resumes at the saved step (nothing left to do).
    rc, log, _ = torchrun(str(tmp_path), "two", world=2, restarts=1, faults="0:0:convert",
                          extra=["--steps", str(2 * INTERVAL)])
    assert rc == 0, log[-4000:]
    assert "fssdp faults: rank 0 kill at step 0, phase convert" in log
    assert f"resumed at step {2 * INTERVAL} from" in log
    assert sorted(n for n in os.listdir(save_dir) if n.startswith(".")) == [f".universal-{tag}"]
    results = spawn(2, load_on_two, save_dir, tag)  # reuses that conversion
    saved = consolidated_state_dict(save_dir, tag=tag)
    rows = {}  # expert -> (master, moments) from the 4 rank files
    for r in range(WORLD):
        part = load_file(os.path.join(save_dir, tag, "fssdp", f"rank{r:05d}.pt"))
        for l, layer in enumerate(part["layers"]):
            for i, e in enumerate(layer["experts"].tolist()):
                rows[l, e] = (layer["master"][i], {k: v[i] for k, v in layer["optimizer_rows"].items()})
    for rank, res in enumerate(results):
        assert res["step"] == 2 * INTERVAL and res["global_steps"] == 2 * INTERVAL
        assert res["position"] == 2 * INTERVAL * WORLD * 8  # samples drawn by 4 ranks of micro-batch 8
        for key, value in res["dense"].items():
            if key in saved:
                assert torch.equal(value, saved[key]), key
        for l, layer in enumerate(res["experts"]):
            for name, value in layer.items():
                assert torch.equal(value, saved[f"blocks.{l}.moe.{name}"]), (rank, l, name)
        for l, (master, moments, _) in enumerate(res["expert_optimizer"]):
            for i, e in enumerate(res["owned"][l].tolist()):
                assert torch.equal(master[i], rows[l, e][0]), (rank, l, e)
                for k, v in moments.items():
                    assert torch.equal(v[i], rows[l, e][1][k]), (rank, l, e, k)
