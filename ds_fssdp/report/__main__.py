"""``python -m ds_fssdp.report RUN_DIR``: PNGs of a run from its recorded trace (and metrics CSV).

RUN_DIR is a directory holding the trace (``trace.npz`` + ``trace.json``, written when the DeepSpeed
config has ``"fssdp": {"trace_path": ...}``; the main job writes it into its run directory), or a
trace file itself (e.g. /work/shared/data/trace_e8.npz). The placement picture replays the planner
with the settings the runtime recorded in the trace's sidecar; flags override them (for a trace
recorded elsewhere, or to see what another budget would have placed).

``--check``: derive every decision of the run again from the trace's inputs (counts, agreed
windows, optimizer steps, fitted costs; report/check.py) and compare them with the runtime's
record (a pipelined run: every stage's trace). Exit 0 printing how many decisions were checked,
1 naming the first (iteration, layer, array) that differs, 2 when a trace cannot be checked (said
why).
"""
from __future__ import annotations

import argparse
import glob
import sys

from ds_fssdp.defaults import POLICIES
from ds_fssdp.report.render import find_trace, render


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_fssdp.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory (or a trace .npz)")
    p.add_argument("--trace", default=None, help="trace file (default: RUN/trace.npz or the only .npz in RUN)")
    p.add_argument("--metrics", default=None, help="metrics CSV (default: RUN/metrics.csv if present)")
    p.add_argument("--out", default=None, help="where the PNGs go (default: the run directory)")
    p.add_argument("--policy", choices=POLICIES, default=None, help="replay this policy (default: the trace's)")
    p.add_argument("--budget", type=int, default=None, help="materialization budget m for the replay")
    p.add_argument("--overlap-degree", type=int, default=None, help="overlap degree t for the replay")
    p.add_argument("--window", type=int, default=None, help="load predictor window for the replay")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node for the replay")
    p.add_argument("--check", action="store_true",
                   help="check the run's recorded decisions against those derived from the trace's inputs (no PNGs)")
    args = p.parse_args(argv)
    if args.check:
        return _check(args)
    try:
        result = render(args.run, out=args.out, trace_path=args.trace, metrics_path=args.metrics, policy=args.policy,
                        budget=args.budget, overlap_degree=args.overlap_degree, window=args.window,
                        ranks_per_node=args.ranks_per_node)
    except (FileNotFoundError, ValueError) as err:
        print(f"ds_fssdp.report: {err}", file=sys.stderr)
        return 2
    for line in result["summary"]:
        print(line)
    for path in result["files"]:
        print(f"wrote {path}")
    return 0


def _check(args) -> int:
    from ds_fssdp.report.check import CheckRefused, check
    from ds_fssdp.sim.traces import load_trace
    overrides = [f"--{k.replace('_', '-')}" for k in ("policy", "budget", "overlap_degree", "window", "ranks_per_node")
                 if getattr(args, k) is not None]
    try:
        if overrides:  # the check is against the run's own settings
            raise ValueError(f"--check replays the run's recorded settings; refusing {', '.join(overrides)}")
        paths = [args.trace] if args.trace else stage_traces(find_trace(args.run))
        results = [(path, check(load_trace(path))) for path in paths]
    except (FileNotFoundError, CheckRefused, ValueError) as err:
        print(f"ds_fssdp.report --check: {err}", file=sys.stderr)
        return 2
    for path, result in results:
        print(f"trace {path}")
        for line in result.lines():
            print(line)
    return 0 if all(result.first is None for _, result in results) else 1


def stage_traces(path: str) -> list:
    """``path`` and, for a pipelined run, the other stages' traces beside it (``<stem>.stage<s>.npz``,
    written by each stage's first rank: runtime/pipeline.trace_file)."""
    stem = path[:-len(".npz")] if path.endswith(".npz") else path
    return [path] + sorted(glob.glob(f"{glob.escape(stem)}.stage*.npz"))


if __name__ == "__main__":
    sys.exit(main())
