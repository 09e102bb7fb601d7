"""Pipeline parallelism in the cluster simulator: S stages under 1F1B, FSSDP inside each stage.

Legend: S stages, G micro-batches per step, L MoE layers (L_s on stage s), D GPUs (D / S per
stage), N ranks of a group.

``python -m ds_fssdp.sim --pipeline-stages S --micro-batches G`` cuts the model's MoE layers into S
stages as evenly as possible (the later stages take the extra ones; stage 0 also holds the dense
first layers and their compute) and gives each stage D / S GPUs, as the runtime does
(``runtime/pipeline.py``): its groups (EP's, FSSDP's: the stage's data-parallel ranks by default)
live inside it. Each stage is its own :class:`~ds_fssdp.sim.cluster.PolicyRun` fed one micro-batch
per call, so every micro-batch is one iteration of its layers: its own plan, replicas and
dispatch (the runtime's per-micro-batch records), its predictor observing every micro-batch, its
forward and backward priced by the layer schedule (``PolicyRun.phases``; the exposed replica
gathers and reduces are charged to the backward). Each stage's synthetic loads are its own
(seeded by stage).

A step runs DeepSpeed's TrainSchedule on those durations (:func:`one_f_one_b`: stage s runs
min(S - s - 1, G) forwards, then one forward and one backward in turn, then the remaining
backwards; a forward waits for the stage before, a backward for the stage after, plus one
point-to-point transfer of the micro-batch's activations or their gradient, bf16, each GPU's share
of its node's link). Each stage then waits for its gradient sync (what ``PolicyRun`` leaves
exposed after its last backward: the stage's dense and EDP syncs over its own ranks) and its
optimizer step; the step ends with the last stage to finish, plus any re-shard. Re-shard and
SmartMoE intervals count optimizer steps (micro-batches / G).

Replica memory: stage s keeps k = min(G, S - s) micro-batches' replicas until their backward, so
the auto budget (and ``--memory-cap``'s) counts k of them (:func:`~ds_fssdp.planner.knobs.resident_layers`,
the runtime's rule).

The bound: no policy's step is shorter than its busiest stage's work, each micro-batch at least the
workload's lower bound for that stage (:class:`~ds_fssdp.sim.bound.LowerBound` with the sync left
out: it may hide), plus that stage's optimizer step. It has no bubble, so the gap to it includes
1F1B's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from deepspeed.runtime.pipe.schedule import TrainSchedule

from ds_fssdp.planner.knobs import auto_materialization_budget
from ds_fssdp.sim.bound import LowerBound
from ds_fssdp.sim.cluster import PolicyRun
from ds_fssdp.sim.memory import budget_for_cap, optimizer_params
from ds_fssdp.sim.setup import OPT_TRAFFIC_BYTES, PARAM_BYTES, Setup, build_setup
from ds_fssdp.sim.workload import cv_workload


@dataclass
class StagedResult:
    policy: str
    step_s: float  # mean seconds per optimizer step (G micro-batches)
    pipeline_s: float  # of which 1F1B from the first forward to the last backward
    busy_s: list  # per stage: its forwards and backwards
    bubble: float  # 1 - busiest stage's busy / pipeline
    sync_s: float  # exposed gradient sync after the stage's last backward (the stage that ends last)
    opt_s: float
    rearr_s: float
    budget: list  # m per stage
    replicas_per_layer: float
    steps: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "step_ms": 1e3 * self.step_s, "pipeline_ms": 1e3 * self.pipeline_s,
                "busy_ms": [1e3 * b for b in self.busy_s], "bubble": self.bubble, "sync_ms": 1e3 * self.sync_s,
                "opt_ms": 1e3 * self.opt_s, "rearr_ms": 1e3 * self.rearr_s, "budget": self.budget,
                "replicas_per_layer": self.replicas_per_layer, "steps_ms": [1e3 * s for s in self.steps]}


def stage_layers(num_layers: int, stages: int) -> list:
    """MoE layers per stage, as even as possible, the later stages taking the extra ones (stage 0
    also holds the dense first layers)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline stages ({stages}) must be between 1 and the {num_layers} MoE layers")
    base, extra = divmod(num_layers, stages)
    return [base + (s >= stages - extra) for s in range(stages)]


def stage_setups(cluster, model, gpus: int, stages: int, *, micro_batches: int, memory_cap: float | None = None,
                 group_size: int | None = None, **options) -> list:
    """One :class:`~ds_fssdp.sim.setup.Setup` per stage: its D / S GPUs, its layers, its dense part
    (the dense first layers' parameters and compute on stage 0) and its replica budget for the
    micro-batches in flight there."""
    if gpus % stages:
        raise ValueError(f"--pipeline-stages ({stages}) must divide the {gpus} GPUs")
    whole = build_setup(cluster, model, gpus // stages, **options)
    per_layer, first = model.dense_params_per_layer(whole.num_experts), model.extra_dense_params()
    memory = options.get("replica_memory_bytes") or cluster.replica_memory_bytes
    out = []
    for s, L_s in enumerate(stage_layers(whole.num_layers, stages)):
        st = replace(whole, num_layers=L_s, dense_params=L_s * per_layer + (first if s == 0 else 0),
                     extra_compute_s=whole.extra_compute_s if s == 0 else 0.0,
                     reshard_interval=whole.reshard_interval * micro_batches,
                     smartmoe_interval=whole.smartmoe_interval * micro_batches,
                     label=f"{whole.label.rsplit(',', 1)[0]}, stage {s} of {stages} ({gpus // stages} GPUs)")
        k = min(micro_batches, stages - s)
        N = st.topology.num_ranks if group_size is None else group_size
        m, m_rm = (budget_for_cap(st, N, memory_cap, rematerialize=rm, in_flight=k) if memory_cap is not None else
                   auto_materialization_budget(memory_bytes=int(memory), expert_bytes=st.shape.expert_bytes,
                                               num_layers=L_s, rematerialize=rm, in_flight=k) for rm in (False, True))
        out.append(replace(st, budget=m, budget_rm=m_rm))
    return out


def train_order(stages: int, stage: int, micro_batches: int) -> list:
    """Stage ``stage``'s ("F" | "B", micro-batch) in the order DeepSpeed's TrainSchedule runs them."""
    sched = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
    steps = (sched._step_to_micro_batch(i) for i in range(2 * (micro_batches + stages - 1)))
    return [("F" if forward else "B", mb) for mb, forward in steps if sched._valid_micro_batch(mb)]


def one_f_one_b(forward_SG, backward_SG, p2p_s: float = 0.0) -> tuple:
    """DeepSpeed's TrainSchedule on per-stage, per-micro-batch durations ([S, G] each): returns
    (makespan, the time each stage's last backward ends, each stage's busy time)."""
    F, Bw = np.asarray(forward_SG, dtype=np.float64), np.asarray(backward_SG, dtype=np.float64)
    S, G = F.shape
    orders = [train_order(S, s, G) for s in range(S)]
    end = {}
    free, nxt = np.zeros(S), [0] * S
    while any(nxt[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                dep = None  # a forward waits for the stage before, a backward for the stage after
                if kind == "F" and s > 0:
                    dep = (s - 1, "F", i)
                elif kind == "B" and s < S - 1:
                    dep = (s + 1, "B", i)
                if dep is not None and dep not in end:
                    break
                ready = free[s] if dep is None else max(free[s], end[dep] + p2p_s)
                free[s] = end[(s, kind, i)] = ready + (F[s, i] if kind == "F" else Bw[s, i])
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for this order
    last = np.array([end[(s, "B", G - 1)] for s in range(S)])
    return float(last.max()), last, F.sum(1) + Bw.sum(1)


def p2p_seconds(setup: Setup, d_model: int) -> float:
    """One micro-batch's activations (or their gradient) from a stage to the next, bf16: each GPU's
    share of its node's link (stages span whole nodes), or its intra-node link."""
    hw, G = setup.hw, setup.topology.ranks_per_node
    bw = hw.inter_bw / G if setup.topology.num_nodes > 1 or G > 1 else hw.intra_bw
    return hw.latency + setup.tokens_per_gpu * d_model * PARAM_BYTES / bw


def simulate_stages(setups: list, policies, *, micro_batches: int, steps: int, load_cv: float, seed: int,
                    top_k: int, d_model: int, group_size: int | None = None, dispatcher=None, schedule=None,
                    max_groups: int | None = None) -> tuple:
    """``(results, lower bound seconds per step, per-stage trace summaries)``: every policy on every
    stage, micro-batch by micro-batch, then 1F1B step by step over the timed steps (those whose
    micro-batches all come after the predictor's first window)."""
    G, S = micro_batches, len(setups)
    phases = {p: [[] for _ in range(S)] for p in policies}  # per stage, per micro-batch
    replicas = dict.fromkeys(policies, 0.0)
    budgets = {p: [] for p in policies}
    bound_SM, opt_bound_S, summaries = [], [], []
    for s, st in enumerate(setups):
        N = st.topology.num_ranks if group_size is None else group_size
        runs = [PolicyRun(name, st, group_size=N if name.startswith("fssdp") else min(N, st.num_experts),
                          max_groups=max_groups, dispatcher=dispatcher, schedule=schedule) for name in policies]
        free = replace(st, dense_params=0)  # its bound without the sync: it may hide
        bound = LowerBound(free, group_size=N, budget=max(r.budget for r in runs),
                           plain=max([r.budget for r in runs if r.fssdp and not r.rm], default=0),
                           groups=max_groups)
        owned = math.ceil(st.num_experts * st.num_layers / N) * st.shape.params
        opt_free = float(optimizer_params(free, owned, N)) * OPT_TRAFFIC_BYTES / st.hw.hbm_bw
        source = cv_workload(st, top_k=top_k, steps=G * steps, load_cv_target=load_cv, seed=seed + s)
        micro = []
        for m, tokens_LED in enumerate(source):
            tokens_LED = np.asarray(tokens_LED)
            for run in runs:
                run.step(m, tokens_LED)
                phases[run.name][s].append(run.phases)
            before = bound.total
            bound.step(max(m, st.load_window), tokens_LED)  # every micro-batch (the step skips the window)
            micro.append(bound.total - before - opt_free)  # its layers and the dense compute, not the step
        for run in runs:
            r = run.result()
            replicas[run.name] += r.replicas_per_layer * st.num_layers
            budgets[run.name].append(run.budget)
        bound_SM.append(micro)
        opt_bound_S.append(float(optimizer_params(st, owned, N)) * OPT_TRAFFIC_BYTES / st.hw.hbm_bw)
        summaries.append(source.summary(st.load_window))
    first = math.ceil(setups[0].load_window / G)
    timed = range(first, steps)
    if not timed:
        raise ValueError(f"--steps ({steps}) must exceed {first}: the steps before the predictor's first window of "
                         f"{setups[0].load_window} micro-batches are not timed")
    p2p = p2p_seconds(setups[0], d_model)
    results = []
    for name in policies:
        totals, records = [], []
        for k in timed:
            ph = [phases[name][s][k * G:(k + 1) * G] for s in range(S)]
            F = [[p["forward"] + p["comp"] / 3.0 for p in stage] for stage in ph]  # comp: the dense layers (fwd 1/3)
            B = [[p["backward"] + p["spag"] + 2.0 * p["comp"] / 3.0 for p in stage] for stage in ph]
            makespan, last, busy = one_f_one_b(F, B, p2p)
            sync = [stage[-1]["ar"] for stage in ph]
            opt = [stage[-1]["opt"] for stage in ph]
            done = last + np.array(sync) + np.array(opt)
            ends = int(np.argmax(done))
            rearr = max(sum(p["rearr"] for p in stage) for stage in ph)  # the stages re-shard side by side
            totals.append(float(done.max()) + rearr)
            records.append((makespan, busy, sync[ends], opt[ends], rearr))
        n = len(records)
        busy = [float(np.mean([r[1][s] for r in records])) for s in range(S)]
        pipeline = float(np.mean([r[0] for r in records]))
        results.append(StagedResult(policy=name, step_s=float(np.mean(totals)), pipeline_s=pipeline, busy_s=busy,
                                    bubble=1.0 - max(busy) / pipeline, sync_s=sum(r[2] for r in records) / n,
                                    opt_s=sum(r[3] for r in records) / n, rearr_s=sum(r[4] for r in records) / n,
                                    budget=budgets[name], replicas_per_layer=replicas[name] / sum(
                                        st.num_layers for st in setups), steps=totals))
    low = float(np.mean([max(sum(bound_SM[s][k * G:(k + 1) * G]) + opt_bound_S[s] for s in range(S)) for k in timed]))
    return results, low, summaries


def format_stages(label: str, stages: int, micro_batches: int, setups: list, results: list, lower_s: float) -> str:
    by = {r.policy: r.step_s for r in results}
    lines = [f"{label}: {stages} pipeline stages x {setups[0].topology.num_ranks} GPUs, {micro_batches} micro-batches "
             f"per step (1F1B), MoE layers per stage {[st.num_layers for st in setups]}, "
             f"{setups[0].tokens_per_gpu} tokens/GPU per micro-batch",
             "",
             f"{'policy':<10} {'ms/step':>9} {'xEP':>5} {'xFMoE':>6} {'/LB':>5} | {'1F1B':>8} {'bubble':>6} "
             f"{'sync':>6} {'opt':>6} {'rearr':>6} | busy ms per stage" + " " * 8 + "m per stage   repl/L",
             "-" * 124]
    for r in results:
        xep = f"{by['ep'] / r.step_s:5.2f}" if "ep" in by else "    -"
        xfm = f"{by['fsmoe'] / r.step_s:6.2f}" if "fsmoe" in by else "     -"
        lines.append(f"{r.policy:<10} {1e3 * r.step_s:9.1f} {xep} {xfm} {r.step_s / lower_s:5.2f} | "
                     f"{1e3 * r.pipeline_s:8.1f} {100 * r.bubble:5.1f}% {1e3 * r.sync_s:6.1f} {1e3 * r.opt_s:6.1f} "
                     f"{1e3 * r.rearr_s:6.1f} | {'/'.join(f'{1e3 * b:.0f}' for b in r.busy_s):<24} "
                     f"{'/'.join(str(m) for m in r.budget) if r.policy.startswith('fssdp') else '-':<13} "
                     f"{r.replicas_per_layer:6.1f}")
    lines += ["", f"lower bound {1e3 * lower_s:.1f} ms per step (the busiest stage's micro-batches at the workload's "
                  "bound, plus its optimizer step; no bubble)",
              "1F1B = first forward to last backward; bubble = 1 - busiest stage's busy time / 1F1B; sync = the "
              "gradient sync exposed after the last stage to finish; m = replicas per rank per layer (the "
              "micro-batches in flight counted)"]
    return "\n".join(lines)


def run_cli(args, out, *, cluster, model, policies: list, setup_options: dict, schedule, dispatcher) -> int:
    """``python -m ds_fssdp.sim --pipeline-stages S``: the table (or ``--json``) for the cluster
    preset's synthetic load-CV workload, every policy under the same stages."""
    import json

    from ds_fssdp.sim.workload import DEFAULT_LOAD_CV, SYNTHETIC
    S = args.pipeline_stages
    G = 4 * S if args.micro_batches is None else args.micro_batches
    if args.trace != SYNTHETIC:
        raise SystemExit(f"--pipeline-stages ({S}) models the synthetic load-CV workload (--trace synthetic), each "
                         f"stage's own; got --trace {args.trace}")
    if G < 1:
        raise SystemExit(f"--micro-batches ({G}) must be >= 1")
    if args.gpus % S:
        raise SystemExit(f"--pipeline-stages ({S}) must divide --gpus ({args.gpus})")
    if args.group_size not in (None, args.gpus // S):
        raise SystemExit(f"--group-size ({args.group_size}) with --pipeline-stages {S}: the groups are each stage's "
                         f"{args.gpus // S} data-parallel GPUs (EP's at most the expert count)")
    setups = stage_setups(cluster, model, args.gpus, S, micro_batches=G, memory_cap=args.memory_cap,
                          calibration=bool(args.calibration), **setup_options)
    cv = DEFAULT_LOAD_CV if args.load_cv is None else args.load_cv
    steps = args.steps if args.steps is not None else math.ceil(setups[0].load_window / G) + 2
    results, low, summaries = simulate_stages(setups, policies, micro_batches=G, steps=steps, load_cv=cv,
                                              seed=args.seed, top_k=model.top_k, d_model=model.d_model,
                                              dispatcher=dispatcher, schedule=schedule, max_groups=args.max_groups)
    label = f"cluster {cluster.name.upper()}, {model.name}, {args.gpus} GPUs"
    if args.json:
        json.dump({"label": label, "pipeline_stages": S, "micro_batches": G, "steps": steps,
                   "stages": [st.summary() for st in setups], "traces": summaries,
                   "results": [r.to_dict() for r in results], "lower_bound_ms": 1e3 * low,
                   "vs_lower_bound": {r.policy: r.step_s / low for r in results},
                   "speedup_vs_ep": {r.policy: results[[x.policy for x in results].index("ep")].step_s / r.step_s
                                     for r in results} if "ep" in policies else {}}, out, indent=1)
        print(file=out)
    else:
        print(format_stages(label, S, G, setups, results, low), file=out)
        print(f"trace: synthetic, load CV {cv}, seeds {args.seed}..{args.seed + S - 1} (one per stage), {steps} steps "
              f"of {G} micro-batches, timed from step {math.ceil(setups[0].load_window / G)}", file=out)
    return 0
