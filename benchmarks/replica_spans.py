"""Which replica collectives are in flight during each MoE layer's timed forward and backward span
on 2 gloo CPU ranks (the runtime's own spans, ``moe/timing.py``): what ``validate_schedule.py``'s
layer loads must carry (``planner.schedule.LayerLoad.other_*_bytes``).

    python benchmarks/replica_spans.py [--budget 2] [--steps 10] [--json out.json]

The same model, data and config as ``validate_schedule.py`` (policy fssdp, degree 1; its
options), run through that script's arm with probes added (nothing here changes a result):

* every SparseAllGather / SparseReduceScatter start records its layer, its bytes sent and the
  last span boundary before it ("issued after");
* at each boundary (a layer's forward start and end, each of its token exchanges' start and end,
  its backward start and end) every pending collective is polled (``Work.is_completed``): the
  first boundary at which it has landed is its "landed by" (a finished ``finish()`` counts as
  landed, so a collective nobody polls in time shows the next step's first boundary).

Per (kind, layer): counts of (issued after, landed by) over the timed steps and the median
seconds from issue to the boundary it was first seen landed at (an upper bound of its duration).
Also, per layer and rank: median forward and backward spans against ``schedule.pipeline_time``
of the same loads with the arm's fitted costs, with and without the other collectives' bytes,
and the spans less their token exchanges against the fitted compute (``gemm``);
and per span start, how far apart the two ranks reach it (same host clock): the earlier rank
waits that long inside its span, in the exchange.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import validate_schedule as vs  # noqa: E402

from ds_fssdp.moe.timing import _Stamp  # noqa: E402  (identity whose backward calls back)

_STATE = {"events": [], "clock": [], "layer_of": {}, "works": [], "timings": {}}
_ARM = vs.run_arm  # validate_schedule's own arm


def _install():
    import ds_fssdp
    from ds_fssdp.comm import sparse
    from ds_fssdp.moe import timing
    from ds_fssdp.moe.replicas import ReplicaManager
    st = _STATE

    def poll(where):
        now = time.perf_counter()
        st["events"].append(where)
        st["clock"].append((where, now))
        for w in st["works"]:
            if w["landed_by"] is None and (w["obj"]._work is None or w["obj"]._work.is_completed()):
                w["landed_by"], w["seconds"] = where, now - w["t"]

    for name in ("start_gather", "_reduce_start"):  # the layer whose replica manager starts the collective
        def started_by(self, *args, orig=getattr(ReplicaManager, name), **kwargs):
            st["layer"] = st["layer_of"].get(id(self))
            return orig(self, *args, **kwargs)
        setattr(ReplicaManager, name, started_by)

    for cls, kind in ((sparse.SparseAllGather, "gather"), (sparse.SparseReduceScatter, "reduce")):
        def start(self, orig=cls.start, kind=kind):
            out = orig(self)
            if self._work is not None:
                st["works"].append({"kind": kind, "layer": st.get("layer"), "bytes": self.sent,
                                    "issued_after": st["events"][-1] if st["events"] else None, "obj": self,
                                    "t": time.perf_counter(), "landed_by": None, "seconds": None})
            return out
        cls.start = start

    orig_layer, orig_exchange = timing.LayerTimings.layer, timing.LayerTimings.exchange

    def layer(self, fn, x, route, **kw):
        name = f"L{st['layer_of'].get(id(self))}"

        def wrapped(v):
            poll(f"{name} fwd start")
            y = fn(v)
            poll(f"{name} fwd end")
            if y.requires_grad:
                y.register_hook(lambda g: poll(f"{name} bwd start"))
            return y
        if x.requires_grad:
            x = _Stamp.apply(x, lambda _t: poll(f"{name} bwd end"))  # identity; its backward calls back
        return orig_layer(self, wrapped, x, route, **kw)

    def exchange(self, fn, x, out_splits, in_splits):
        name = f"L{st['layer_of'].get(id(self))}"

        def wrapped(v):
            poll(f"{name} a2a start")
            y = fn(v)
            poll(f"{name} a2a end")
            return y
        return orig_exchange(self, wrapped, x, out_splits, in_splits)

    timing.LayerTimings.layer, timing.LayerTimings.exchange = layer, exchange
    orig_init = ds_fssdp.initialize

    def initialize(*a, **k):
        out = orig_init(*a, **k)
        for i, shard in enumerate(out[0].fssdp.shards):
            st["layer_of"][id(shard.timings)] = st["layer_of"][id(shard.replicas)] = i
            st["timings"][i] = shard.timings
        return out
    ds_fssdp.initialize = initialize


def _run_arm(args, rank, policy, degree, upfront):
    from ds_fssdp.planner.schedule import LayerLoad, pipeline_time
    _install()
    out = _ARM(args, rank, policy, degree, upfront)
    costs = out["costs"]
    groups = collections.defaultdict(list)
    for w in _STATE["works"]:
        groups[(w["kind"], w["layer"])].append(w)
    collectives = {}
    for (kind, layer), ws in sorted(groups.items(), key=str):
        ws = ws[-args.steps:]  # one per timed step (the warm-up's dropped)
        seen = [w["seconds"] for w in ws if w["seconds"] is not None]
        collectives[f"{kind} L{layer}"] = {
            "bytes_sent": statistics.median(w["bytes"] for w in ws),
            "issued_after_landed_by": [[list(k), v] for k, v in sorted(collections.Counter(
                (w["issued_after"], w["landed_by"]) for w in ws).items(), key=str)],
            "seconds_to_seen_landed_median": statistics.median(seen) if seen else None}
    layers = {}
    for i, t in sorted(_STATE["timings"].items()):
        f, b = t.samples("layer_fwd")[-args.steps:], t.samples("layer_bwd")[-args.steps:]

        def ms(v):
            return statistics.median(v) * 1e3
        plain = [LayerLoad(*u[:4]) for u, _ in f]
        full = [LayerLoad(*u) for u, _ in f]
        layers[f"L{i}"] = {"forward_ms": ms([s for _, s in f]), "backward_ms": ms([s for _, s in b]),
                           "predicted_forward_ms": ms([pipeline_time(costs, ld, 1) for ld in full]),
                           "predicted_forward_without_other_ms": ms([pipeline_time(costs, ld, 1) for ld in plain]),
                           "predicted_backward_ms": ms([pipeline_time(costs, ld, 1, backward=True) for ld in full]),
                           # the spans less the token exchanges in them, against the fitted compute
                           "compute_forward_ms": ms([s for _, s in t.samples("compute_fwd")[-args.steps:]]),
                           "compute_backward_ms": ms([s for _, s in t.samples("compute_bwd")[-args.steps:]]),
                           "predicted_compute_forward_ms": ms([costs.gemm(ld.local_rows + ld.remote_rows)
                                                               for ld in plain]),
                           "predicted_compute_backward_ms": ms([costs.backward_factor * costs.gemm(ld.local_rows +
                                                                                                   ld.remote_rows)
                                                                for ld in plain]),
                           "other_bytes_last": list(f[-1][0][4:])}
    out["probe"] = {"collectives": collectives, "layers": layers,
                    "span_starts": [(w, t) for w, t in _STATE["clock"] if w.endswith(("fwd start", "bwd start"))]}
    d = os.environ.get("REPLICA_SPANS_DIR")  # set by main() before the ranks are spawned
    if d:
        with open(os.path.join(d, f"probe{rank}.json"), "w") as f:
            json.dump(out["probe"], f)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--json" in argv:
        i = argv.index("--json")
        path = argv[i + 1]
        del argv[i:i + 2]
    probes = {}
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["REPLICA_SPANS_DIR"] = tmp
        vs.main(argv + ["--policies", "fssdp", "--degrees", "1"])
        for rank in (0, 1):
            with open(os.path.join(tmp, f"probe{rank}.json")) as f:
                probes[f"rank{rank}"] = json.load(f)
    # Both ranks read the same host clock (perf_counter: CLOCK_MONOTONIC): the k-th start of a span
    # on rank 0 against rank 1's, over the timed steps. Its median |difference| is the skew the
    # earlier rank waits out inside its span (the exchange synchronises them).
    starts = [collections.defaultdict(list) for _ in range(2)]
    for r in range(2):
        for w, t in probes[f"rank{r}"].pop("span_starts"):
            starts[r][w].append(t)
    skew = {}
    for w in sorted(starts[0]):
        a, b = starts[0][w], starts[1].get(w, [])
        n = min(len(a), len(b), _steps(argv))
        d = [a[-i] - b[-i] for i in range(1, n + 1)]
        skew[w] = {"median_abs_ms": statistics.median(abs(x) for x in d) * 1e3,
                   "median_rank0_minus_rank1_ms": statistics.median(d) * 1e3}
    probes["span_start_skew"] = skew
    print(json.dumps(probes, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump({"script": "benchmarks/replica_spans.py", "argv": argv, "load_average_at_end": os.getloadavg(),
                       "probe": probes}, f, indent=1)
    return probes


def _steps(argv) -> int:
    return vs.parse_args(argv).steps


vs.run_arm = _run_arm  # in the spawned ranks too: they import this script as __mp_main__


if __name__ == "__main__":
    main()
