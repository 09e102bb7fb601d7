"""python -m ds_fssdp.sim --trace FILE|synthetic --cluster a --model gpt-s-moe --gpus 32 [--json]

Replays the trace through each policy on the cost model of the chosen cluster and model, prints a
table (time per iteration, speedup over EP and FasterMoE, Figure 11's breakdown, Figure 12's
model-state memory) and writes a PNG bar chart. ``--json`` prints the same as JSON instead.

At cluster scale (:mod:`ds_fssdp.sim.cluster`; chosen by ``--group-size``, ``--load-cv``,
``--memory-cap``, ``--max-groups`` or a fixed model preset such as ``deepseek-v3-671b``), with EP
groups of at most E (DeepSpeed's ``ep_size`` divides the experts) and calibration off by default
(the runtime's default too):

    python -m ds_fssdp.sim --trace synthetic --cluster b --model deepseek-v3-671b --gpus 1024 \
        --group-size 64 --load-cv 0.5 --memory-cap 1.2 --steps 20
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys

# --json: stdout carries the JSON alone. DeepSpeed's logger writes to the stdout it finds when it
# is imported, and it warns "Setting accelerator to CPU" on import, so a script run with --json
# sends stdout to stderr before anything imports DeepSpeed; main() writes the JSON to the real one.
_SCRIPT_STDOUT = sys.stdout
if __name__ == "__main__" and "--json" in sys.argv[1:]:
    sys.stdout = sys.stderr

import torch  # noqa: E402  (after the redirect above)

from ds_fssdp.config import FSSDPConfig
from ds_fssdp.planner.schedule import MAX_DEGREE
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.sim.cluster import CLUSTER_POLICIES, SIM_POLICY_NAMES, simulate, simulate_cluster
from ds_fssdp.sim.foresight import PREDICTORS
from ds_fssdp.sim.presets import CLUSTERS, MODELS, cluster_preset, model_preset
from ds_fssdp.sim.report import format_table, to_json
from ds_fssdp.sim.setup import ZERO_STAGES, build_setup
from ds_fssdp.sim.pipeline import SERIAL, ScheduleOptions
from ds_fssdp.sim.traces import save_trace
from ds_fssdp.sim.workload import DEFAULT_LOAD_CV, SYNTHETIC, cv_workload, trace_for_setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ds_fssdp.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="trace .npz (docs/traces.md), or 'synthetic'")
    p.add_argument("--cluster", default="a", choices=sorted(CLUSTERS))
    p.add_argument("--model", default="gpt-s-moe", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--policies", default=None, help=f"comma-separated, of {','.join(SIM_POLICY_NAMES)} (default: all; "
                   f"at cluster scale {','.join(CLUSTER_POLICIES)})")
    p.add_argument("--group-size", type=int, default=None, help="EP / FSSDP groups of this many GPUs (default: the "
                   "world; EP's at most the expert count)")
    p.add_argument("--memory-cap", type=float, default=None, help="FSSDP's m from this multiple of EP's model-state "
                   "memory")
    p.add_argument("--max-groups", type=int, default=None, help="simulate only the first this many groups (alike "
                   "under a synthetic trace; cheaper, may miss a slower group)")
    p.add_argument("--steps", type=int, default=None, help="steps to replay (default: all of a recorded trace, 200 "
                   "synthetic)")
    p.add_argument("--start", type=int, default=0, help="first step of a recorded trace")
    p.add_argument("--target-std", type=float, default=None, help="synthetic: std of expert load share (default "
                   "0.04; paper presets)")
    p.add_argument("--load-cv", type=float, default=None, help=f"synthetic: coefficient of variation of expert load "
                   f"(default {DEFAULT_LOAD_CV} for fixed presets)")
    p.add_argument("--drift", type=float, default=None, help="synthetic: 1 - step correlation of the preferences")
    p.add_argument("--jitter", type=float, default=None, help="synthetic: fraction of fresh noise per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-concentration", type=float, default=None,
                   help="remap: Dirichlet alpha splitting a recorded expert into several (default: equal split)")
    p.add_argument("--tokens-per-gpu", type=int, default=None)
    p.add_argument("--replica-memory-gb", type=float, default=None)
    p.add_argument("--overlap-degree", type=int, default=None, help="t, fixed for every layer and step (default: "
                   "from each replica gather's window: the attention forward, and with the idle link the previous "
                   "layer's expert compute)")
    p.add_argument("--budget", type=int, default=None, help="m for fssdp (default: from replica memory)")
    p.add_argument("--budget-rm", type=int, default=None, help="m for fssdp-rm (default: from replica memory)")
    p.add_argument("--flexmoe-slots", type=int, default=None)
    p.add_argument("--flexmoe-threshold", type=float, default=1.2)
    p.add_argument("--flexmoe-interval", type=int, default=1)
    p.add_argument("--smartmoe-interval", type=int, default=25)
    p.add_argument("--reshard-interval", type=int, default=100)
    p.add_argument("--dispatch", default="paper", choices=["paper", "balanced"],
                   help="token dispatch of every policy: the paper's Algorithm 3 (Themis as published) or the "
                   "runtime's balancing dispatcher (with the config's default dispatch_slack)")
    p.add_argument("--calibration", action=argparse.BooleanOptionalAction, default=None,
                   help="FSSDP calibration (default: on in the paper's report, off at cluster scale)")
    p.add_argument("--calibration-budget", type=float, default=1.0, help="in attention forward times")
    p.add_argument("--pipeline-degree", default="auto", help="FSSDP's and fsmoe's chunks per token exchange: "
                   "'auto' (chosen per layer, forward and backward, by planner.onecopy.choose_exchange) or 1-8 "
                   "(1: the serial exchange)")
    p.add_argument("--dedup", choices=("auto", "on", "off"), default="on", help="FSSDP: one copy per destination "
                   "(a token crosses to a rank once): always (the runtime's default), where the modelled layer "
                   "is faster with it (planner.onecopy.choose_exchange), or never")
    p.add_argument("--no-dedup", action="store_true", help="the same as --dedup off")
    p.add_argument("--no-grad-gaps", action="store_true", help="FSSDP, fsmoe: the gradient all-reduce overlaps the "
                   "backward as before, not only its link gaps")
    p.add_argument("--no-idle-link", action="store_true", help="FSSDP: replicas gathered within the attention "
                   "forward only (default: from the previous layer's expert compute on)")
    p.add_argument("--t-by", choices=("time", "window"), default="time", help="FSSDP with the idle link: t per "
                   "layer searched by the modelled layer time from the window's t up (planner/overlap.py), or the "
                   "window's t alone")
    p.add_argument("--predictor", choices=PREDICTORS, default="window", help="the loads pre-gating plans on: the "
                   "runtime's sliding window, or 'oracle' (each layer's actual loads, sim/foresight.py; a what-if: "
                   "what the decisions cost when the prediction is right); the paper's report only")
    p.add_argument("--no-price-by-schedule", action="store_true", help="FSSDP: calibration and the balanced-time "
                   "dispatch price plans by the serial layer time (default: the schedule's)")
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation: trace rows (micro-steps) per "
                   "optimizer step; the sync, the optimizer step and the re-shards once per optimizer step, as the "
                   "runtime's (default 1)")
    p.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage of the optimizer state, every policy alike "
                   "(sim/sync.py): 0 replicated, gradients all-reduced before the step; 1 partitioned (dense over the "
                   "world, experts over their EDP group), gradients reduce-scattered and parameters all-gathered "
                   "(FSSDP and fsmoe: the experts' during the next forward). Cluster scale only")
    p.add_argument("--communication-data-type", choices=("bf16", "fp32", "fp16"), default=None,
                   help="DeepSpeed's communication_data_type: the gradient sync's dtype, dense and experts, every "
                   "policy alike (planner/sync_dtype.py; default: DeepSpeed's for the modelled bf16 training, bf16)")
    p.add_argument("--serial", action="store_true", help="today's serial accounting for every policy: degree 1, "
                   "no dedup, no gradient gaps, no idle-link gathers")
    p.add_argument("--png", default=None, help="chart path (default sim_<cluster>_<model>_<gpus>.png)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--save-trace", default=None, help="also write the replayed (remapped/synthetic) trace here")
    p.add_argument("--pipeline-stages", type=int, default=1, help="pipeline stages under 1F1B, FSSDP inside each "
                   "stage's GPUs (sim/stages.py; a synthetic load-CV workload)")
    p.add_argument("--micro-batches", type=int, default=None, help="with --pipeline-stages: micro-batches per step "
                   "(default 4 x stages)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p.parse_args(argv)


def schedule_options(args) -> ScheduleOptions:
    """FSSDP's layer schedule from the flags (``--serial``: all off, degree 1)."""
    if args.serial:
        return SERIAL
    d = args.pipeline_degree
    if d != "auto":
        try:
            d = int(d)
        except ValueError:  # refused below, by its text
            d = 0
        if not 1 <= d <= MAX_DEGREE:
            raise SystemExit(f"--pipeline-degree ({args.pipeline_degree}) must be 'auto' or an integer in [1, "
                             f"{MAX_DEGREE}]")
    dedup = False if args.no_dedup else {"auto": "auto", "on": True, "off": False}[args.dedup]
    return ScheduleOptions(pipeline_degree=None if d == "auto" else d, dedup=dedup,
                           grad_gaps=not args.no_grad_gaps, idle_link=not args.no_idle_link,
                           price_by_schedule=not args.no_price_by_schedule, t_by_time=args.t_by == "time")


def parse_policies(text: str, known, where: str) -> list:
    """``--policies``' comma-separated names, each one of ``known``."""
    policies = [p for p in text.split(",") if p]
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise SystemExit(f"--policies: unknown {unknown}; known{where}: {', '.join(known)}")
    return policies


def main(argv=None, *, out=None) -> int:
    """Run the CLI; the table or the JSON goes to ``out`` (default: stdout). With ``--json``
    nothing else does: whatever the run prints goes to stderr."""
    args = parse_args(argv)
    out = sys.stdout if out is None else out
    if not args.json:
        return _run(args, out)
    with contextlib.redirect_stdout(sys.stderr):
        return _run(args, out)


def _run(args, out) -> int:
    torch.set_num_threads(1)  # small tensors: threads cost more than they give
    if args.gas < 1:
        raise SystemExit(f"--gas ({args.gas}) must be >= 1 (micro-steps per optimizer step)")
    if args.gas != 1 and args.pipeline_stages != 1:
        raise SystemExit(f"--gas ({args.gas}) with --pipeline-stages ({args.pipeline_stages}): the stages' "
                         "micro-batches are the accumulation (--micro-batches)")
    if args.micro_batches is not None and args.pipeline_stages == 1:
        raise SystemExit(f"--micro-batches ({args.micro_batches}) needs --pipeline-stages above 1")
    dispatcher = functools.partial(dispatch_plan, mode=args.dispatch, slack=FSSDPConfig().dispatch_slack)
    cluster, model = cluster_preset(args.cluster), model_preset(args.model)
    memory = None if args.replica_memory_gb is None else args.replica_memory_gb * 1e9
    options = dict(tokens_per_gpu=args.tokens_per_gpu, replica_memory_bytes=memory, overlap_degree=args.overlap_degree,
                   reshard_interval=args.reshard_interval, smartmoe_interval=args.smartmoe_interval,
                   calibration_budget=args.calibration_budget, zero_stage=args.zero_stage,
                   communication_data_type=args.communication_data_type)  # the Setup's, every path alike
    if args.pipeline_stages != 1:
        if args.pipeline_stages < 1:
            raise SystemExit(f"--pipeline-stages ({args.pipeline_stages}) must be >= 1")
        from ds_fssdp.sim.stages import run_cli
        policies = parse_policies(args.policies or "ep,fsmoe,fssdp,fssdp-rm", CLUSTER_POLICIES, " with pipeline stages")
        return run_cli(args, out, cluster=cluster, model=model, policies=policies, setup_options=options,
                       schedule=schedule_options(args), dispatcher=dispatcher)
    at_scale = model.fixed or any(v is not None for v in (args.group_size, args.load_cv, args.memory_cap,
                                                          args.max_groups))
    known = CLUSTER_POLICIES if at_scale else SIM_POLICY_NAMES
    policies = parse_policies(args.policies or ",".join(known), known, " at cluster scale" if at_scale else "")
    if args.load_cv is not None and args.target_std is not None:
        raise SystemExit("--load-cv and --target-std both set: give one skew")
    if args.zero_stage not in ZERO_STAGES:
        raise SystemExit(f"--zero-stage ({args.zero_stage}) must be one of {ZERO_STAGES}: ZeRO 2 (partitioned "
                         "gradients) and 3 (partitioned parameters) are not modelled")
    if args.zero_stage and not at_scale:
        raise SystemExit(f"--zero-stage ({args.zero_stage}): modelled at cluster scale only (give --group-size); "
                         "the paper's report models ZeRO 0")
    if args.memory_cap is not None and (args.budget is not None or args.budget_rm is not None):
        raise SystemExit(f"--memory-cap ({args.memory_cap}) chooses m: do not also give --budget / --budget-rm")
    schedule = schedule_options(args)
    calibration = (not at_scale) if args.calibration is None else args.calibration
    setup = build_setup(cluster, model, args.gpus, budget=args.budget, budget_rm=args.budget_rm,
                        flexmoe_slots=args.flexmoe_slots, flexmoe_threshold=args.flexmoe_threshold,
                        flexmoe_interval=args.flexmoe_interval, calibration=calibration, gas=args.gas, **options)
    synth = {k: v for k, v in (("drift", args.drift), ("jitter", args.jitter)) if v is not None}
    if at_scale and args.trace == SYNTHETIC and args.target_std is None:
        cv = DEFAULT_LOAD_CV if args.load_cv is None else args.load_cv
        source = cv_workload(setup, top_k=model.top_k, steps=args.steps, load_cv_target=cv, seed=args.seed, **synth)
        trace = None
    else:
        if args.load_cv is not None:
            raise SystemExit(f"--load-cv ({args.load_cv}) needs --trace synthetic")
        std = 0.04 if args.target_std is None else args.target_std
        trace, trace_summary = trace_for_setup(setup, args.trace, top_k=model.top_k, steps=args.steps,
                                               start=args.start, target_std=std, seed=args.seed,
                                               split_concentration=args.split_concentration, **synth)
        source = trace.tokens_SLED
    if args.save_trace:
        if trace is None:
            raise SystemExit("--save-trace: a load-CV trace is generated as it is read; it is not kept")
        save_trace(args.save_trace, trace)
    if at_scale and args.predictor != "window":
        raise SystemExit(f"--predictor {args.predictor}: the paper's report only (at cluster scale each group plans "
                         f"on its own window)")
    if at_scale:
        results = simulate_cluster(setup, source, policies, group_size=args.group_size, memory_cap=args.memory_cap,
                                   overlap_degree=args.overlap_degree, max_groups=args.max_groups,
                                   dispatcher=dispatcher, schedule=schedule)
        if trace is None:
            trace_summary = source.summary(setup.load_window)
    else:
        results = simulate(setup, source, policies, dispatcher=dispatcher, schedule=schedule,
                           fixed_t=args.overlap_degree is not None, predictor=args.predictor)
    summary = dict(setup.summary(), dispatch=args.dispatch, predictor=args.predictor,
                   group_size=args.group_size or args.gpus, schedule=dataclasses.asdict(schedule))
    if not args.no_png:
        png = args.png or f"sim_{cluster.name}_{model.name}_{args.gpus}.png"
        from ds_fssdp.sim.plot import plot_results  # matplotlib only when plotting (0.4 s)
        plot_results(png, results, title=f"{summary['label']}; {trace_summary.get('description', '')}")
        summary["png"] = png
    if args.json:
        json.dump(to_json(summary, trace_summary, results), out, indent=1)
        print(file=out)
    else:
        print(format_table(summary, trace_summary, results), file=out)
        if "png" in summary:
            print(f"chart: {summary['png']}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main(out=_SCRIPT_STDOUT))
