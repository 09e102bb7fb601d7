"""GPU arms of the layer schedule (issue 24): the pipelined layer at degree 1 against "auto", and
one copy per destination off against on. One GPU, no other rank: imports only torch, triton (through
ds_fssdp.ops) and ds_fssdp.ops, so it runs under benchmarks/gpu/run.sh's stub package;
``planner/schedule.py`` (pure, numpy) is loaded from this checkout by path for the model.

Legend: T tokens, K top-k, E experts, D ranks, H hidden, F expert FFN hidden, R rows, n degree.

    python benchmarks/gpu/schedule_arms.py [--json out.json] [--quick] [--device cuda|cpu]

Without CUDA it prints a skip line, writes ``{"skipped": ...}`` and exits 0 (``--device cpu`` runs
the same code serially on tiny shapes: a logic check whose times mean nothing).

**Pipelined layer, emulated** (per family, one rank's share of a D-rank layer): the exchange is an
asynchronous copy of the same bytes on a side CUDA stream (device -> pinned host: a copy engine,
no SMs, about PCIe's rate, close to one inter-node NIC); the expert compute is ``ops.expert_mlp``
(forward; backward: input and weight gradients of each chunk's graph) on the compute stream. At
degree n the rows of the rank's own tokens (1/D of them) are computed first, the remote rows arrive
in n chunks, and the copies run in ``schedule``'s link order D1 D2 C1 D3 C2 ... Cn, each combine
after its chunk's compute (events), exactly the schedule ``planner/schedule.pipeline_time``
models. Measured: every degree 1..8, forward and backward. "auto" is ``schedule.choose_degree``
on ``ScheduleCosts`` fitted (``schedule.fit_schedule_costs``) from this GPU's copy and GEMM
timings at a few sizes; reported: degree 1's time, auto's degree and time, the best measured
degree, and the model's prediction of each degree beside the measurement.

**Shared experts beside the exchange** (families with ``S`` shared expert rows per token: DeepSeek's
one): the same pipeline with the rank's S x T shared rows computed once the last combine is
launched (``moe/side.py``; at degree 1 after the combine, in sequence, as the block runs them);
reported per degree beside the model's ``pipeline_time`` with ``LayerLoad.side_rows``, and its
"auto" degree.

**One copy per destination** (DeepSeek-like routing, top-8 of 256 experts over 8 ranks, Zipf-skewed
gate): off sends one row per (token, expert) assignment, grouped by destination; on sends one row
per (token, destination rank) and the receiver expands it to its (token, expert) rows. Reported:
rows and bytes sent (the saving), and the permutation time of each (off: the send buffer's
gather; on: the send gather plus the receiver's expanding gather), forward.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

from ds_fssdp import ops

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULE_PY = os.path.join(HERE, "..", "..", "ds_fssdp", "planner", "schedule.py")

# One rank's share: tokens per rank T, top-k, experts E over D ranks, hidden, expert FFN hidden.
FAMILIES = {
    "mixtral": dict(T=8192, K=2, E=8, D=4, H=4096, F=14336),
    "deepseek": dict(T=4096, K=8, E=256, D=8, H=7168, F=2048, S=1),
}
QUICK = {"mixtral": dict(T=4096), "deepseek": dict(T=2048)}
CPU = {"mixtral": dict(T=64, H=64, F=128), "deepseek": dict(T=32, H=64, F=32, E=16)}
MAX_DEGREE = 8


def load_schedule():
    """planner/schedule.py from this checkout (pure; needs numpy), or None."""
    try:
        spec = importlib.util.spec_from_file_location("fssdp_schedule", SCHEDULE_PY)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fssdp_schedule"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    except Exception as err:  # numpy missing, or the file
        print(f"schedule model unavailable ({type(err).__name__}: {err}); auto is not chosen", flush=True)
        return None


class Clock:
    """Device timing: CUDA events on the compute stream (the side stream joined first), or the host
    clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream() if self.cuda else None

    def time(self, fn, repeats: int) -> float:
        """Median seconds of ``fn()`` after one warm-up."""
        out = []
        for i in range(repeats + 1):
            if self.cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                torch.cuda.current_stream().wait_stream(self.side)
                b.record()
                b.synchronize()
                s = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                s = time.perf_counter() - t0
            if i:
                out.append(s)
        return statistics.median(out)


class Layer:
    """One rank's layer: local rows, remote rows in chunks, the copies that emulate the exchange."""

    def __init__(self, f, *, device, dtype, clock: Clock):
        self.f, self.clock, self.device = f, clock, device
        T, K, E, D, H, F = (f[k] for k in "TKEDHF")
        self.E_local = max(1, E // D)
        self.rows = T * K  # rows this rank computes (balanced)
        self.local_rows = self.rows // D
        self.remote_rows = self.rows - self.local_rows
        self.side_rows = int(f.get("S", 0)) * T  # the shared experts' rows (one expert-sized MLP each)
        self.row_bytes = H * torch.tensor([], dtype=dtype).element_size()
        g = torch.Generator(device="cpu").manual_seed(0)
        self.w = {"w_a": (torch.randn(self.E_local, H, F, generator=g) * H ** -0.5).to(device, dtype).requires_grad_(),
                  "w_b": (torch.randn(self.E_local, F, H, generator=g) * F ** -0.5).to(device, dtype).requires_grad_()}
        self.x = torch.randn(self.rows, H, generator=g).to(device, dtype).requires_grad_()
        self.send = torch.empty(self.remote_rows, H, device=device, dtype=dtype)
        pin = device.type == "cuda"
        self.host = torch.empty(self.remote_rows, H, dtype=dtype, pin_memory=pin)
        self._graphs = {}

    def sizes(self, rows: int) -> list:
        e = self.E_local
        return [rows // e + (i < rows % e) for i in range(e)]

    def chunks(self, n: int) -> list:
        """(start, rows) of the local part, then of n ragged remote chunks."""
        base, extra = divmod(self.remote_rows, n)
        out, start = [(0, self.local_rows)], self.local_rows
        for i in range(n):
            r = base + (i < extra)
            out.append((start, r))
            start += r
        return out

    def copy(self, start: int, rows: int) -> None:
        """The exchange of ``rows`` rows (side stream on CUDA)."""
        if rows:
            a = start - self.local_rows
            self.host[a:a + rows].copy_(self.send[a:a + rows], non_blocking=True)

    def gemm(self, start: int, rows: int, backward: bool, n: int) -> None:
        if not rows:
            return
        if not backward:
            with torch.no_grad():
                ops.expert_mlp(self.x[start:start + rows], self.w, self.sizes(rows), activation="gelu")
            return
        key = (n, start)
        if key not in self._graphs:
            y = ops.expert_mlp(self.x[start:start + rows], self.w, self.sizes(rows), activation="gelu")
            self._graphs[key] = (y, torch.ones_like(y))
        y, gy = self._graphs[key]
        torch.autograd.backward(y, gy, retain_graph=True)

    def run(self, n: int, backward: bool, side: bool = False) -> None:
        """One direction at degree n (module docstring), enqueued on the two streams; ``side``: the
        shared rows computed once the last combine is launched."""
        side_rows = self.side_rows if side else 0
        side = self.clock.side
        cuda = side is not None

        def on_side(fn, wait=None):
            if not cuda:
                return fn()
            with torch.cuda.stream(side):
                if wait is not None:
                    side.wait_event(wait)
                fn()
            ev = torch.cuda.Event()
            ev.record(side)
            return ev

        def on_main(fn, wait=None):
            if cuda and wait is not None:
                torch.cuda.current_stream().wait_event(wait)
            fn()
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
                return ev

        if n == 1:
            d = on_side(lambda: self.copy(self.local_rows, self.remote_rows))
            g = on_main(lambda: self.gemm(0, self.rows, backward, 1), wait=d)
            c = on_side(lambda: self.copy(self.local_rows, self.remote_rows), wait=g)
            if cuda:
                torch.cuda.current_stream().wait_event(c)
            on_main(lambda: self.gemm(0, side_rows, backward, -100))  # the block's, in sequence
            return
        parts = self.chunks(n)
        on_main(lambda: self.gemm(*parts[0], backward, n))
        done_d, done_g, gi = {}, {}, 1
        order = [("d", 1)] + [x for i in range(2, n + 1) for x in (("d", i), ("c", i - 1))] + [("c", n)]
        for kind, i in order:
            if kind == "d":
                done_d[i] = on_side(lambda i=i: self.copy(*parts[i]))
                continue
            while gi <= i:
                done_g[gi] = on_main(lambda gi=gi: self.gemm(*parts[gi], backward, n), wait=done_d[gi])
                gi += 1
            last = on_side(lambda i=i: self.copy(*parts[i]), wait=done_g[i])
        on_main(lambda: self.gemm(0, side_rows, backward, -100))  # beside the last combine
        if cuda:
            torch.cuda.current_stream().wait_event(last)


def fit_costs(layer: Layer, schedule, repeats: int):
    """ScheduleCosts from this device's copy and GEMM timings at a few sizes."""
    clock = layer.clock
    copies, fwd, bwd = [], [], []
    for frac in (8, 4, 2, 1):
        r = max(1, layer.remote_rows // frac)

        def copy(r=r):
            if clock.side is None:
                return layer.copy(layer.local_rows, r)
            with torch.cuda.stream(clock.side):
                layer.copy(layer.local_rows, r)
        copies.append((r * layer.row_bytes, clock.time(copy, repeats)))
        g = max(1, layer.rows // frac)
        fwd.append((g, clock.time(lambda g=g: layer.gemm(0, g, False, -frac), repeats)))
        bwd.append((g, clock.time(lambda g=g: layer.gemm(0, g, True, -frac), repeats)))
    costs, err = schedule.fit_schedule_costs(copies, [], fwd, bwd)
    return costs, err, {"copy": copies, "gemm_fwd": fwd, "gemm_bwd": bwd}


def pipeline_arm(name, f, *, device, dtype, repeats, schedule) -> dict:
    clock = Clock(device)
    layer = Layer(f, device=device, dtype=dtype, clock=clock)
    out = {"shape": f, "rows": layer.rows, "local_rows": layer.local_rows, "remote_rows": layer.remote_rows,
           "exchange_bytes": layer.remote_rows * layer.row_bytes}
    for direction, backward in (("forward", False), ("backward", True)):
        measured = {n: clock.time(lambda n=n: layer.run(n, backward), repeats) for n in range(1, MAX_DEGREE + 1)}
        best = min(measured, key=measured.get)
        d = {"measured_ms": {n: s * 1e3 for n, s in measured.items()}, "degree1_ms": measured[1] * 1e3,
             "best_degree": best, "best_ms": measured[best] * 1e3}
        out[direction] = d
        if layer.side_rows:
            d["side_measured_ms"] = {n: clock.time(lambda n=n: layer.run(n, backward, side=True), repeats) * 1e3
                                     for n in range(1, MAX_DEGREE + 1)}
    if schedule is not None:
        costs, err, samples = fit_costs(layer, schedule, repeats)
        load = schedule.LayerLoad(intra_bytes=float(out["exchange_bytes"]), inter_bytes=0.0,
                                  local_rows=float(layer.local_rows), remote_rows=float(layer.remote_rows))
        out["fit"] = {"error": err, "samples": samples, "costs": {
            "copy": [costs.a2a_intra.startup_s, costs.a2a_intra.per_unit_s],
            "gemm": [costs.gemm.startup_s, costs.gemm.per_unit_s], "backward_factor": costs.backward_factor}}
        for direction, backward in (("forward", False), ("backward", True)):
            d = out[direction]
            auto = schedule.choose_degree(costs, load, backward=backward, max_degree=MAX_DEGREE)
            d["auto_degree"] = auto
            d["auto_ms"] = d["measured_ms"][auto]
            d["auto_speedup_over_degree1"] = d["degree1_ms"] / d["auto_ms"]
            d["predicted_ms"] = {n: schedule.pipeline_time(costs, load, n, backward=backward) * 1e3
                                 for n in range(1, MAX_DEGREE + 1)}
            if layer.side_rows:
                side_load = schedule.LayerLoad(intra_bytes=load.intra_bytes, inter_bytes=0.0,
                                               local_rows=load.local_rows, remote_rows=load.remote_rows,
                                               side_rows=float(layer.side_rows))
                d["side_auto_degree"] = schedule.choose_degree(costs, side_load, backward=backward,
                                                               max_degree=MAX_DEGREE)
                d["side_predicted_ms"] = {n: schedule.pipeline_time(costs, side_load, n, backward=backward) * 1e3
                                          for n in range(1, MAX_DEGREE + 1)}
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def dedup_arm(f, *, device, dtype, repeats) -> dict:
    """One copy per destination off vs on: rows, bytes, permutation time (forward)."""
    T, K, E, D, H = (f[k] for k in "TKEDH")
    g = torch.Generator(device="cpu").manual_seed(1)
    probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float64).pow(1.2)
    idx_TK = torch.stack([torch.multinomial(probs, K, replacement=False, generator=g) for _ in range(T)])
    dest_TK = idx_TK * D // E  # homogeneous owners: expert e on rank e * D // E
    # Off: one row per assignment, in (destination, expert, token) order.
    key = (dest_TK * E + idx_TK) * T + torch.arange(T).view(-1, 1)
    order = torch.argsort(key.view(-1))
    token_off = order // K
    rows_off_TK = torch.empty(T * K, dtype=torch.long)
    rows_off_TK[order] = torch.arange(T * K)
    rows_off_TK = rows_off_TK.view(T, K)
    # On: one row per (token, destination), in (destination, token) order; the receiver expands.
    pair = dest_TK * T + torch.arange(T).view(-1, 1)
    uniq, inverse = torch.unique(pair.view(-1), return_inverse=True)  # sorted: (destination, token)
    token_on = uniq % T
    rows_on_TK = torch.full((T, K), -1, dtype=torch.long)
    first = torch.full((uniq.numel(),), -1, dtype=torch.long)
    flat = inverse.tolist()
    for a, u in enumerate(flat):  # the first k of each (token, destination) owns its row
        if first[u] < 0:
            first[u] = a
    rows_on_TK.view(-1)[first] = torch.arange(uniq.numel())
    expand = inverse[order]  # the receiver's rows in the off order, gathered from the unique rows
    x_TH = torch.randn(T, H, generator=g).to(device, dtype)
    token_off, rows_off_TK, token_on, rows_on_TK, expand = (t.to(device) for t in (token_off, rows_off_TK, token_on,
                                                                                   rows_on_TK, expand))
    clock = Clock(device)
    with torch.no_grad():
        same = torch.equal(ops.permute_tokens(x_TH, token_off, rows_off_TK),
                           ops.permute_tokens(x_TH, token_on, rows_on_TK).index_select(0, expand))
        if not same:
            raise AssertionError("one copy per destination: the expanded rows differ from the rows sent per assignment")
        t_off = clock.time(lambda: ops.permute_tokens(x_TH, token_off, rows_off_TK), repeats)

        def on():  # the send gather, then the receiver's expansion to (token, expert) rows
            return ops.permute_tokens(x_TH, token_on, rows_on_TK).index_select(0, expand)
        t_on = clock.time(on, repeats)
    row_bytes = H * torch.tensor([], dtype=dtype).element_size()
    return {"shape": f, "rows_off": T * K, "rows_on": int(uniq.numel()), "bytes_off": T * K * row_bytes,
            "bytes_on": int(uniq.numel()) * row_bytes, "bytes_saved_fraction": 1 - uniq.numel() / (T * K),
            "permute_off_ms": t_off * 1e3, "permute_on_ms": t_on * 1e3}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="half the tokens")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("schedule arms: skipped (no CUDA device)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "no CUDA device"}, f)
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    schedule = load_schedule()
    out = {"script": "benchmarks/gpu/schedule_arms.py", "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu (logic check only)", "dtype": str(dtype), "pipeline": {}, "dedup": {}}
    for name, f in FAMILIES.items():
        f = {**f, **(QUICK[name] if args.quick else {}), **(CPU[name] if device.type == "cpu" else {})}
        t0 = time.perf_counter()
        r = pipeline_arm(name, f, device=device, dtype=dtype, repeats=args.repeats, schedule=schedule)
        out["pipeline"][name] = r
        for direction in ("forward", "backward"):
            d = r[direction]
            auto = (f"auto n={d['auto_degree']} {d['auto_ms']:.2f} ms ({d['auto_speedup_over_degree1']:.2f}x), "
                    f"model {d['predicted_ms'][d['auto_degree']]:.2f} ms" if "auto_degree" in d else "auto: no model")
            print(f"pipeline {name} {direction}: degree 1 {d['degree1_ms']:.2f} ms, {auto}; best measured "
                  f"n={d['best_degree']} {d['best_ms']:.2f} ms  [{time.perf_counter() - t0:.0f} s]", flush=True)
            if "side_measured_ms" in d:
                m = d["side_measured_ms"]
                best = min(m, key=m.get)
                model = (f", auto n={d['side_auto_degree']} {m[d['side_auto_degree']]:.2f} ms (model "
                         f"{d['side_predicted_ms'][d['side_auto_degree']]:.2f})" if "side_auto_degree" in d else "")
                print(f"  with shared experts beside the exchange: degree 1 {m[1]:.2f} ms{model}; best measured "
                      f"n={best} {m[best]:.2f} ms", flush=True)
        out["dedup"][name] = d = dedup_arm(f, device=device, dtype=dtype, repeats=args.repeats)
        print(f"one copy per destination {name}: rows {d['rows_off']} -> {d['rows_on']} "
              f"({d['bytes_saved_fraction']:.1%} of the bytes saved), permutation {d['permute_off_ms']:.3f} -> "
              f"{d['permute_on_ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
