"""What the simulator's CLI costs: wall and CPU seconds of the scale runs and the schedule workloads.

    python benchmarks/sim_speed.py --json benchmarks/results/sim_speed_after48.json [--only S3,W1] [--jobs 2]
    python benchmarks/sim_speed.py --compare DIR ...   # also check each run's numbers against DIR/<name>.json

Runs each command of :data:`COMMANDS` (issue 48's S1-S3 at ``--policies ep,fssdp --steps 20``, and
the schedule issue's four workloads W1-W4 with all their policies) as its own process with
``--json --no-png``, and records its wall seconds, its CPU seconds (user + sys, from ``wait4``:
the child's own, so ``--jobs`` > 1 keeps them apart) and the host's load average before and
after. A CLI run has no warm-up to discard: its wall is what a user waits. ``--compare DIR``:
each run's JSON, less the measured planning times (``planning_ms``, ``total_ms``), must equal
DIR/<name>.json's the same way (the exit status is 1 otherwise). A model, not a measurement of the
cluster: what is timed is the simulator itself, on this host.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

SIM = [sys.executable, "-m", "ds_fssdp.sim"]
SCALE = "--trace synthetic --cluster b --policies ep,fssdp --steps 20"
CAP = "--trace synthetic --cluster b --gpus 64 --memory-cap 1.2 --steps 8"
COMMANDS = {
    "S1": f"{SCALE} --model deepseek-v3-671b --gpus 1024 --group-size 64",
    "S2": f"{SCALE} --model qwen3-30b-a3b --gpus 256 --group-size 32",
    "S3": f"{SCALE} --model mixtral-8x7b --gpus 64 --group-size 8",
    "W1": f"{CAP} --model deepseek-v3-671b --group-size 64",
    "W2": f"{CAP} --model qwen3-30b-a3b --group-size 8",
    "W3": f"{CAP} --model mixtral-8x7b --group-size 8",
    "W4": "--trace /work/shared/data/trace_e8.npz --cluster a --model gpt-s-moe --gpus 32 --steps 30",
}
MEASURED = ("planning_ms", "total_ms", "png")  # CPU time measured by the run itself: not the model's numbers


def deterministic(out):
    """The run's JSON without what it measured (its planning time)."""
    if isinstance(out, dict):
        return {k: deterministic(v) for k, v in out.items() if k not in MEASURED}
    if isinstance(out, list):
        return [deterministic(v) for v in out]
    return out


def run(name: str, timeout: float) -> dict:
    args = COMMANDS[name].split() + ["--json", "--no-png"]
    load = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out:
        wall = time.perf_counter()
        proc = subprocess.Popen(SIM + args, stdout=out, stderr=subprocess.DEVNULL)
        try:
            _, status, usage = os.wait4(proc.pid, 0) if timeout <= 0 else _wait(proc, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            status = None
        wall = time.perf_counter() - wall
        out.seek(0)
        text = out.read()
    record = {"name": name, "command": "python -m ds_fssdp.sim " + " ".join(args), "wall_s": wall,
              "cpu_s": usage.ru_utime + usage.ru_stime, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
              "max_rss_mb": usage.ru_maxrss / 1024, "load_before": load, "load_after": os.getloadavg(),
              "finished": status == 0}
    if status == 0:
        record["result"] = json.loads(text)
    return record


def _wait(proc, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return pid, status, usage
        time.sleep(0.2)
    raise subprocess.TimeoutExpired(proc.args, timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(COMMANDS), help=f"comma-separated of {','.join(COMMANDS)}")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each run's CPU time stays its own)")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds a run may take (0: no limit)")
    p.add_argument("--compare", default=None, help="directory of <name>.json references (sim --json outputs)")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown or args.jobs < 1:
        raise SystemExit(f"--only: unknown {unknown} (known {list(COMMANDS)}); --jobs ({args.jobs}) must be >= 1")
    with ThreadPoolExecutor(args.jobs) as pool:
        records = list(pool.map(lambda n: run(n, args.timeout), names))
    failed = False
    for r in records:
        same = None
        if args.compare and r["finished"]:
            ref = os.path.join(args.compare, f"{r['name']}.json")
            if os.path.exists(ref):
                with open(ref) as f:
                    same = deterministic(json.load(f)) == deterministic(r["result"])
                failed |= not same
        r["same_as_reference"] = same
        print(f"{r['name']}: wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s, load {r['load_before'][0]:.1f}"
              f" -> {r['load_after'][0]:.1f}, finished {r['finished']}, same numbers {same}", file=sys.stderr)
    if args.json:
        host = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
        with open(args.json, "w") as f:
            json.dump({"host": host, "compare": args.compare, "runs": records}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
