"""Expert data parallelism: owners' gradients across FSSDP groups, and where the expert optimizer
state lives (``fssdp.group_size``; docs/design.md section 2, "Expert optimizer state" and
"Gradients / Parameters / Updates in the gaps", and "Precision" in section 5).

Legend: S rows owned by this rank, P elements per expert, N ranks of the EDP group, C elements of
this rank's slice (the S * P owned elements split into N contiguous slices, sizes differing by at
most one).

* ``ReplicatedExperts`` (ZeRO stage 0, or one FSSDP group): every owner keeps the fp32 master and
  moments of its rows; gradients are all-reduced over the EDP group (on a split step:
  reduce-scattered, and each layer's all-gather and update land at its rows' first use).
* ``PartitionedExperts`` (ZeRO stage >= 1 with more than one group): EDP rank j keeps only slice j
  of its rows' fp32 master and moments; gradients are reduce-scattered into the slices and the
  stepped slices all-gathered back into the compute rows (deferred to the rows' first use with
  gradients in the gaps).

The global-norm clip counts each expert once: every rank counts its slice j of each layer's
reduced gradient, disjoint over the world. Every collective of the gradient sync sends
``comm_dtype`` (DeepSpeed's ``communication_data_type``): the gradient is scaled by ``scale``
(DeepSpeed's 1 / world) in fp32 first, then cast once (the division before the sum, as
DeepSpeed's reduce-scatter and ``prescale_gradients``), and the sum lands in the fp32 master or
slice gradient; in fp32 every cast is the identity. Every method that reads or writes the rows or
slices lands their pending write first (``ShardedExperts.land``).

Both give the stage, re-sharding and checkpoints one interface: ``params()`` (what the expert
optimizer steps), ``full_state(i)`` / ``set_state(i, ...)`` (layer i's full fp32 master and row
states of the owned rows; collective over the EDP group when partitioned), ``migrate(i, ...)``
(new owners inside the FSSDP group) and ``state_bytes()``.
"""
from __future__ import annotations

import functools

import torch
from deepspeed import comm as dist

from ds_fssdp.planner.sync_dtype import expert_sync_dtype
from ds_fssdp.runtime.reshard import migrate_rows


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # planner/sync_dtype.py's names
NAMES = {v: k for k, v in DTYPES.items()}


def engine_comm_dtype(engine, training: torch.dtype) -> torch.dtype:
    """The experts' gradient sync dtype for ``engine`` training in ``training``:
    :func:`~ds_fssdp.planner.sync_dtype.expert_sync_dtype` on its DeepSpeed config (the function
    the simulators price the sync with), which must be DeepSpeed's own choice for its gradients
    (``engine.communication_data_type``): a DeepSpeed whose rule changed is refused by name."""
    name = expert_sync_dtype(engine._config._param_dict, training=NAMES[training],
                             sequence_parallel=getattr(engine, "sequence_parallel_size", 1) > 1)
    if DTYPES[name] != engine.communication_data_type:
        raise RuntimeError(f"fssdp: the experts' gradient sync would send {name} (communication_data_type), DeepSpeed's "
                           f"engine sends its gradients in {engine.communication_data_type}: "
                           "planner/sync_dtype.py no longer follows this DeepSpeed")
    return DTYPES[name]


def make_expert_state(shards: list, *, zero_stage: int, edp_group, edp_size: int, edp_rank: int,
                      comm_dtype: torch.dtype):
    """The layout for this run: partitioned with ZeRO >= 1 over an EDP group of more than one rank;
    ``comm_dtype``: the gradient sync's (module docstring)."""
    if zero_stage >= 1 and edp_size > 1:
        return PartitionedExperts(shards, edp_group=edp_group, edp_size=edp_size, edp_rank=edp_rank,
                                  comm_dtype=comm_dtype)
    return ReplicatedExperts(shards, edp_group=edp_group if edp_size > 1 else None, edp_size=edp_size,
                             edp_rank=edp_rank, comm_dtype=comm_dtype)


def _is_row_state(value, param) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape == param.shape


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def _write(rows: torch.Tensor, whole) -> None:
    """Copy the gathered flat whole (``whole()`` waits for it) into ``rows`` (nothing to copy
    where it was gathered into them)."""
    flat = whole()
    if flat.data_ptr() != rows.data_ptr():
        rows.copy_(flat.view_as(rows))


def _complete(works: list, complete) -> None:
    """Wait for a started reduce's collectives, then run its completion."""
    for w in works:
        if w is not None:
            w.wait()
    complete()


def _step_alone(optimizer, param) -> None:
    """Step ``optimizer`` for ``param`` only: the others' gradients are hidden meanwhile (torch's
    Adam, AdamW and SGD skip a parameter without one and keep their state per parameter)."""
    hidden = [p for group in optimizer.param_groups for p in group["params"] if p is not param and p.grad is not None]
    grads = [p.grad for p in hidden]
    for p in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, g in zip(hidden, grads):
            p.grad = g


class _ExpertState:
    partitioned = False
    split = False  # a split step (replicated only)

    def __init__(self, shards: list, *, edp_group, edp_size: int, edp_rank: int, comm_dtype: torch.dtype):
        self.shards = shards
        self.edp_group, self.n, self.j = edp_group, edp_size, edp_rank
        self.comm_dtype = comm_dtype  # the gradient sync's (module docstring)
        self.optimizer = None  # the expert optimizer over params(), set by the stage
        self._inflight = {}  # layer -> (works, completion) of a reduce started in the gaps
        self._reduced = set()  # layers whose reduce this step has landed (their gradient is final)
        self._summed = {}  # layer -> this rank's slice of its summed gradient (split steps), until publish

    @staticmethod
    def _pieces(numel: int, slice_elems: int) -> list:
        """[start, end) ranges of ``slice_elems`` elements covering ``numel`` (none for 0)."""
        step = max(1, int(slice_elems))
        return [(a, min(a + step, numel)) for a in range(0, numel, step)]

    def _sizes(self, numel: int) -> list:
        return [numel // self.n + (k < numel % self.n) for k in range(self.n)]

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        sizes = self._sizes(full.numel())
        return full.reshape(-1).split(sizes)[self.j]

    def _start_reduce_scatter(self, flat: torch.Tensor, slice_elems: int) -> tuple:
        """This rank's slice of ``flat`` summed over the EDP group, asynchronously: piece [a, b) of
        every rank's slice is one reduce-scatter (the same per-element sums as one collective).
        Returns the collectives and this rank's slice, final once they are waited for."""
        sizes = self._sizes(flat.numel())
        if not flat.numel():
            return [], flat[:0]
        offsets = [sum(sizes[:k]) for k in range(self.n)]
        out_C = flat.new_empty(sizes[0])
        works = []
        for a, b in self._pieces(sizes[0], slice_elems):
            buf_NC = flat.new_zeros(self.n, b - a)
            for k in range(self.n):
                end = min(b, sizes[k])
                if end > a:
                    buf_NC[k, :end - a] = flat[offsets[k] + a:offsets[k] + end]
            works.append(dist.reduce_scatter_tensor(out_C[a:b], buf_NC.view(-1), group=self.edp_group, async_op=True))
        return works, out_C[:sizes[self.j]]

    def _gather(self, part: torch.Tensor, numel: int, *, async_op: bool = False, into: torch.Tensor | None = None):
        """Start the all-gather of every rank's slice (``part``: this rank's) of ``numel`` elements;
        returns a callable that waits for it and gives the flat [numel] whole. ``into``: a
        contiguous tensor of ``numel`` elements of ``part``'s dtype that nothing reads until the
        whole is waited for: gathered in place when the slices are equal (no buffer), and the
        whole is then ``into`` itself."""
        sizes = self._sizes(numel)
        if not numel:
            return lambda: part.new_empty(0)
        mine = part.new_zeros(sizes[0])
        mine[:part.numel()] = part
        in_place = (into is not None and into.is_contiguous() and into.dtype == part.dtype
                    and into.numel() == numel and numel % self.n == 0)
        out_NC = into.view(self.n, sizes[0]) if in_place else part.new_empty(self.n, sizes[0])
        work = dist.all_gather_into_tensor(out_NC.view(-1), mine, group=self.edp_group, async_op=async_op)

        def whole() -> torch.Tensor:
            if work is not None:
                work.wait()
            return into.view(-1) if in_place else torch.cat([out_NC[k, :n] for k, n in enumerate(sizes)])
        return whole

    def _start_landings(self, parts: dict, write, *, deferred: bool, into=None) -> list:
        """Start the all-gather of each layer's slice (``parts``: layer -> this rank's slice), in
        layer order (``into(i)``: where layer i may be gathered in place, :meth:`_gather`);
        ``write(i, whole)`` lands layer i now or, ``deferred``, at its rows' first use
        (``ShardedExperts.defer``). Returns the layers deferred."""
        for i in sorted(parts):
            s = self.shards[i]
            s.land()  # the last step's, where nothing used the rows since
            gathered = self._gather(parts[i], s.rows.numel(), async_op=deferred, into=None if into is None else into(i))
            landing = functools.partial(write, i, gathered)
            if deferred:
                s.defer(landing)
            else:
                landing()
        return sorted(parts) if deferred else []

    def clear_grads(self) -> None:
        """Drop the step's gradients (after it, applied or not)."""
        for p in self.params():
            p.grad = None

    @property
    def in_flight(self) -> int:
        """Layers whose gap reduce was started and has not landed."""
        return len(self._inflight)

    @torch.no_grad()
    def wait_in_flight(self) -> None:
        """Land every reduce started in the gaps (their results stay for the step) and every
        layer's all-gather deferred by ``publish``."""
        for i in sorted(self._inflight):
            _complete(*self._inflight.pop(i))
            self._reduced.add(i)
        for s in self.shards:
            s.land()

    @torch.no_grad()
    def reduce(self, scale: float) -> torch.Tensor:
        """Scale the accumulated gradients and sum them over the EDP group (the layers not already
        reduced in the gaps): as :meth:`start_reduce` does, in one collective per layer, waited.
        Returns this rank's part of the global squared norm: its slice of every layer (disjoint over
        the EDP group; replicated, the same elements split or not, so the same norm). Lands what is
        in flight first (gap reduces, deferred all-gathers, a split step's updates)."""
        self.wait_in_flight()
        # on the rows' device (the CPU for a pipeline stage without MoE layers)
        sq = torch.zeros((), dtype=torch.float32, device=self.shards[0].rows.device if self.shards else "cpu")
        for i, s in enumerate(self.shards):
            if i not in self._reduced:
                _complete(*self._start(i, scale, s.rows.numel()))
            sq += self.reduced_slice(i).pow(2).sum()
        self._reduced = set()
        return sq

    def start_reduce(self, i: int, scale: float, slice_elems: int) -> int:
        """Start layer ``i``'s reduce (asynchronous, sliced); returns the collectives issued."""
        if i in self._inflight or i in self._reduced:
            raise RuntimeError(f"fssdp: layer {i}'s expert gradient reduce was already started this step")
        works, complete = self._start(i, scale, slice_elems)
        self._inflight[i] = (works, complete)
        return len(works)

    def params(self) -> list:
        raise NotImplementedError

    def migrate(self, i: int, new_owner_E, group) -> int:
        """Layer i's full state (gathered over the EDP group when partitioned) moved inside the FSSDP
        group to ``new_owner_E`` as a re-shard does (the master, its per-element optimizer state and
        separate low-precision rows), then set again (re-sliced). Returns the bytes this rank sent."""
        if self._inflight:
            raise RuntimeError(f"fssdp: re-sharding while expert gradient reduces of layers {sorted(self._inflight)} "
                               "are in flight (wait_in_flight first)")
        s = self.shards[i]
        new_owner_E = new_owner_E.to("cpu", torch.long)
        if torch.equal(new_owner_E, s.owner_E):
            return 0
        move = functools.partial(migrate_rows, old_owner_E=s.owner_E, new_owner_E=new_owner_E, rank=s.rank,
                                 group=group)
        master_SP, rows, scalars = self.full_state(i)  # lands the rows first
        new_master, sent = move(master_SP)
        moved, compute = {}, None
        for k, v in rows.items():
            moved[k], n = move(v)
            sent += n
        if s.master is not s.rows:  # replicated low-precision rows move as they are
            compute, n = move(s.rows.detach())
            sent += n
        self.set_state(i, owner_E=new_owner_E, master_SP=new_master, rows=moved, scalars=scalars, compute_SP=compute)
        return sent

    def state_bytes(self) -> dict:
        params = sum(_nbytes(s.rows) for s in self.shards)
        master, stored = self._master_bytes()
        opt = sum(_nbytes(v) for p in self.params() for v in self._state(p).values() if _is_row_state(v, p))
        return {"expert_params": params, "expert_master": master, "expert_optimizer": opt,
                "expert_total": params + stored + opt}

    def _state(self, param) -> dict:
        return self.optimizer.state.get(param, {}) if self.optimizer is not None else {}

    def _adopt(self, old, new, state) -> None:
        """``new`` replaces ``old`` in the optimizer, with ``state`` (None or empty: fresh)."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        self.optimizer.state.pop(old, None)
        if state:
            self.optimizer.state[new] = state

    def scalars(self, i: int) -> dict:
        """Layer i's optimizer state that is not per element (Adam's ``step``): the same on every
        rank that steps the layer (no collective)."""
        p = self.params()[i]
        return {k: v for k, v in self._state(p).items() if not _is_row_state(v, p)}

    def row_keys(self, i: int) -> list:
        """Names of layer i's per-element optimizer state (``exp_avg``, ``momentum_buffer``)."""
        p = self.params()[i]
        return sorted(k for k, v in self._state(p).items() if _is_row_state(v, p))



class ReplicatedExperts(_ExpertState):
    """Full fp32 master and moments on every owner (see the module docstring)."""

    def params(self) -> list:
        return [s.master for s in self.shards]

    def reduced_slice(self, i: int) -> torch.Tensor:
        """This rank's slice of layer i's reduced gradient (after :meth:`reduce`), in fp32: what a
        split step holds, or the same elements of the all-reduced gradient."""
        return self._summed[i].float() if self.split else self._slice(self.shards[i].master.grad)

    @torch.no_grad()
    def _start(self, i: int, scale: float, slice_elems: int) -> tuple:
        """Layer i's reduce started: all-reduced into the master's gradient, or on a split step
        reduce-scattered into this rank's slice. Returns (collectives, completion)."""
        s = self.shards[i]
        if s.master.grad is None:
            s.master.grad = torch.zeros_like(s.master)
        flat = s.master.grad.mul_(scale).view(-1)
        if self.split:
            works, part = self._start_reduce_scatter(flat.to(self.comm_dtype), slice_elems)
            s.master.grad = None
            return works, lambda: self._summed.__setitem__(i, part)
        if self.edp_group is None:
            return [], lambda: None
        sent = flat.to(self.comm_dtype)  # flat itself in fp32
        works = [dist.all_reduce(sent[a:b], group=self.edp_group, async_op=True)
                 for a, b in self._pieces(sent.numel(), slice_elems)]
        # the all-reduced gradient into the fp32 one (nothing where it was reduced in place)
        return works, (lambda: None) if sent is flat else (lambda: flat.copy_(sent))

    def publish(self, *, deferred: bool = False, factor: float = 1.0) -> list:
        """Copy each master into its compute rows (a local copy: never deferred; returns []). On a
        split step (the stage stepped nothing): start every trainable layer's all-gather of its
        summed-gradient slices, in layer order, and land each (:meth:`_update`, with ``factor``,
        the step's unscale/clip factor) now or, ``deferred``, at its rows' first use. Returns the
        layers deferred."""
        if not self.split:
            for s in self.shards:
                s.copy_master_to_rows()
            return []
        parts = {i: self._summed[i] for i, s in enumerate(self.shards) if s.trainable}
        self._summed = {}
        return self._start_landings(parts, functools.partial(self._update, factor=factor), deferred=deferred)

    @torch.no_grad()
    def _update(self, i: int, whole, *, factor: float) -> None:
        """Layer i's part of a split step: its summed gradient (``whole()`` waits for the gather)
        times ``factor`` as its master's gradient, the expert optimizer stepped for that master
        alone (with the hyperparameters it holds now: the step's), the master into the rows. A
        gradient the master holds meanwhile (a landing at the next step's reduce) is kept."""
        s = self.shards[i]
        master, held = s.master, s.master.grad
        grad = whole().view_as(master).to(master.dtype)  # gathered in the communication dtype
        if factor != 1.0:
            grad.mul_(factor)
        master.grad = grad
        _step_alone(self.optimizer, master)
        master.grad = held
        s.copy_master_to_rows()

    def clear_grads(self) -> None:
        super().clear_grads()
        self._summed = {}  # a split step not applied: nothing is gathered, nothing updates

    def full_state(self, i: int) -> tuple:
        self.shards[i].land()  # a split step's update: the master and moments a checkpoint takes
        master = self.shards[i].master
        state = self._state(master)
        rows = {k: state[k].detach() for k in self.row_keys(i)}
        return master.detach().float(), rows, self.scalars(i)

    @torch.no_grad()
    def set_state(self, i: int, *, owner_E, master_SP, rows=None, scalars=None, compute_SP=None) -> None:
        """``compute_SP``: the low-precision rows where they are separate (None: the master cast)."""
        s = self.shards[i]
        s.land()  # a pending update steps the master replaced here
        device = s.master.device
        master = master_SP.to(device=device, dtype=torch.float32, copy=True).requires_grad_(True)
        if compute_SP is None:
            compute_SP = master.detach().to(s.rows.dtype)
        compute = master if s.master is s.rows else compute_SP.requires_grad_(True)
        state = None if rows is None else dict({k: v.to(device) for k, v in rows.items()}, **(scalars or {}))
        self._adopt(s.master, master, state)
        s.set_owners(owner_E, rows=compute, master=master)

    def _master_bytes(self) -> tuple:
        """(fp32 master bytes, bytes stored besides the rows)."""
        return (sum(s.master.numel() * 4 for s in self.shards),
                sum(_nbytes(s.master) for s in self.shards if s.master is not s.rows))


class PartitionedExperts(_ExpertState):
    """fp32 master and moments sliced over the EDP group (see the module docstring)."""

    partitioned = True

    def __init__(self, shards: list, **kw):
        super().__init__(shards, **kw)
        self.slices = []
        for s in shards:
            full = s.master.detach().float()
            self.slices.append(self._slice(full).clone().requires_grad_(True))
            s.set_owners(s.owner_E, rows=s.rows, master=s.rows)  # no full master any more

    def params(self) -> list:
        return list(self.slices)

    def _scaled_flat(self, s, scale: float) -> torch.Tensor:
        """The rows' gradient scaled in fp32, flat, in the communication dtype (what is sent)."""
        g = s.rows.grad
        if g is None:
            return s.rows.new_zeros(s.rows.numel(), dtype=self.comm_dtype)
        return (g.float().reshape(-1) * scale).to(self.comm_dtype)

    def reduced_slice(self, i: int) -> torch.Tensor:
        return self.slices[i].grad

    @torch.no_grad()
    def _start(self, i: int, scale: float, slice_elems: int) -> tuple:
        """Layer i's reduce-scatter into its slice's gradient started: (collectives, completion)."""
        s = self.shards[i]
        flat = self._scaled_flat(s, scale)
        s.rows.grad = None
        works, part = self._start_reduce_scatter(flat, slice_elems)
        return works, lambda: setattr(self.slices[i], "grad", part.float())

    @torch.no_grad()
    def publish(self, *, deferred: bool = False, factor: float = 1.0) -> list:
        """All-gather the updated slices into every layer's compute rows; ``deferred``: start every
        all-gather now, in layer order, and leave each layer's landing to its rows' first use
        (module docstring). ``factor``: applied by the stage before it stepped the slices. Returns
        the layers deferred."""
        # in the rows' dtype: the bytes the rows hold (half of fp32 under bf16), the same rows bitwise
        # (the copy into them rounds each element alike before or after the gather)
        parts = {i: p.detach().to(self.shards[i].rows.dtype) for i, p in enumerate(self.slices)}
        # into the rows themselves: nothing reads them before the landing (module docstring), so
        # all layers in flight hold no copy of them
        return self._start_landings(parts, lambda i, whole: _write(self.shards[i].rows, whole), deferred=deferred,
                                    into=lambda i: self.shards[i].rows.detach())

    @torch.no_grad()
    def full_state(self, i: int) -> tuple:
        s, p = self.shards[i], self.slices[i]
        s.land()  # what a checkpoint or a migration takes: the rows then hold this master
        numel, shape = s.rows.numel(), s.rows.shape
        state = self._state(p)
        rows = {k: self._gather(state[k], numel)().view(shape) for k in self.row_keys(i)}
        return self._gather(p.detach(), numel)().view(shape), rows, self.scalars(i)

    @torch.no_grad()
    def set_state(self, i: int, *, owner_E, master_SP, rows=None, scalars=None, compute_SP=None) -> None:
        s = self.shards[i]
        s.land()  # the pending write targets the rows replaced here
        device = s.rows.device
        full = master_SP.to(device=device, dtype=torch.float32)
        compute = full.to(s.rows.dtype, copy=True).requires_grad_(True)
        s.set_owners(owner_E, rows=compute, master=compute)
        p = self._slice(full).clone().requires_grad_(True)
        state = None
        if rows is not None:
            state = {k: self._slice(v.to(device)).clone() for k, v in rows.items()}
            state.update(scalars or {})
        self._adopt(self.slices[i], p, state)
        self.slices[i] = p

    def _master_bytes(self) -> tuple:
        master = sum(_nbytes(p) for p in self.slices)
        return master, master
