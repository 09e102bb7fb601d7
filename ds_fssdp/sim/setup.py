"""Everything a simulation needs besides the trace: cluster, model, derived knobs.

Legend: L layers, E experts, D ranks.

Knobs derived as the runtime's "auto" settings would (ds_fssdp.planner.knobs):

* overlap degree t = floor(T_attn * bw / Psi), T_attn the attention forward time of one layer on
  the rank's tokens and bw the node's inter-node bandwidth (the binding link when nodes > 1; the
  rank's intra-node bandwidth on one node);
* budget m from ``replica_memory_bytes``: a replica holds 2 Psi (parameters + gradient); without
  re-materialization all L layers' replicas are alive at the forward/backward turn; with it, two
  layers' (fssdp-rm's larger budget);
* FlexMoE's reserved slots from the same memory at 8 Psi per slot (parameters, gradient and the
  fp32 master + Adam moments: 2 + 2 + 12 bytes per parameter), at least one.
* FSSDP calibration's latency budget (the paper's "profiled latency budget", no number given):
  ``calibration_budget`` attention forwards (1.0).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.inputs import PlannerSettings
from ds_fssdp.planner.knobs import auto_materialization_budget
from ds_fssdp.planner.sync_dtype import configured_dtype, expert_sync_bytes
from ds_fssdp.sim.presets import ClusterPreset, ModelPreset
from ds_fssdp.topology import Topology

# Mixed-precision Adam, bytes per parameter.
PARAM_BYTES = 2  # bf16 parameters
GRAD_BYTES = 2  # bf16 gradients
TRAINING_DTYPE = "bf16"  # what the simulators model: bf16 parameters and gradients, fp32 optimizer state
OPT_BYTES = 12  # fp32 master, Adam m and v
MIGRATE_BYTES = PARAM_BYTES + OPT_BYTES  # a moved expert carries parameters and optimizer state
OPT_TRAFFIC_BYTES = 28  # optimizer step: read grad 2, read+write master 8, m 8, v 8, write param 2
ZERO_STAGES = (0, 1)  # what the simulators model (sim/sync.py)


@dataclass(frozen=True)
class Setup:
    topology: Topology
    hw: Hardware
    shape: ExpertShape
    num_layers: int
    num_experts: int
    tokens_per_gpu: int
    attention_flops_per_token: float
    dense_params: int  # per rank, all layers (data parallel)
    overlap_degree: int
    budget: int
    budget_rm: int
    flexmoe_slots: int
    reshard_interval: int = 100
    smartmoe_interval: int = 25
    flexmoe_threshold: float = 1.2
    flexmoe_interval: int = 1
    calibration: bool = True
    calibration_budget: float = 1.0  # calibration's critical-path latency budget, in attention forwards
    load_window: int = 5
    top_k: int = 1  # routed experts per token (one copy per destination's model)
    extra_compute_s: float = 0.0  # per iteration, fwd + bwd, alike under every policy (the dense layers)
    # shared experts per token per MoE layer, in expert rows: the layers' work beside the exchange
    # (sim/pipeline.py; in sequence at degree 1, beside a chunked exchange otherwise)
    side_ratio: float = 0.0
    hbm_bytes: float = 0.0  # per GPU (0: unknown)
    # ZeRO stage of the optimizer state (sim/sync.py, sim/memory.py): 0 replicated, 1 partitioned (the
    # dense part over the world, the experts over their EDP group)
    zero_stage: int = 0
    # gradient accumulation: trace rows (micro-steps) per optimizer step; the sync, the optimizer step and
    # the re-shards once per optimizer step, as the runtime's (sim/cluster.py)
    gas: int = 1
    # DeepSpeed's "communication_data_type" (planner/sync_dtype.py): the dtype of the gradient sync,
    # dense and experts alike (None: DeepSpeed's default for bf16 training, bf16)
    communication_data_type: str | None = None
    label: str = ""

    def __post_init__(self):
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage ({self.zero_stage!r}) must be 0 or 1: the simulators model ZeRO 0 (replicated "
                             "optimizer state) and 1 (partitioned optimizer state); 2 (partitioned gradients) and 3 "
                             "(partitioned parameters) are not modelled")
        if isinstance(self.gas, bool) or not isinstance(self.gas, int) or self.gas < 1:
            raise ValueError(f"gas ({self.gas!r}) must be an int >= 1 (micro-steps per optimizer step)")
        configured_dtype({"communication_data_type": self.communication_data_type})  # refused by name

    @property
    def grad_sync_bytes(self) -> int:
        """Bytes per element of the gradient sync: DeepSpeed's communication dtype under bf16
        training, as the runtime's experts and DeepSpeed's own gradients send it (sim/sync.py)."""
        return expert_sync_bytes({"communication_data_type": self.communication_data_type}, training=TRAINING_DTYPE)

    def timed(self, row: int) -> bool:  # row's optimizer step begins after the predictor's first window
        return row - row % self.gas >= self.load_window

    def boundary(self, row: int) -> bool:  # row is its optimizer step's last micro-step
        return row % self.gas == self.gas - 1

    @property
    def rows_needed(self) -> int:  # one whole optimizer step after the load window
        return -(-self.load_window // self.gas) * self.gas + self.gas

    @property
    def attention_fwd_s(self) -> float:
        return self.tokens_per_gpu * self.attention_flops_per_token / self.hw.flops

    def with_hardware(self, hw: Hardware, *, rederive_overlap: bool = True) -> "Setup":
        """Same setup on other hardware; t follows the new bandwidth unless told otherwise."""
        out = replace(self, hw=hw)
        if rederive_overlap:
            out = replace(out, overlap_degree=derive_overlap_degree(hw, self.topology, self.shape,
                                                                    attention_s=out.attention_fwd_s))
        return out

    def summary(self) -> dict:
        return {
            "label": self.label, "gpus": self.topology.num_ranks, "ranks_per_node": self.topology.ranks_per_node,
            "num_layers": self.num_layers, "num_experts": self.num_experts, "tokens_per_gpu": self.tokens_per_gpu,
            "expert_bytes": self.shape.expert_bytes, "attention_fwd_ms": 1e3 * self.attention_fwd_s,
            "overlap_degree": self.overlap_degree, "budget": self.budget, "budget_rm": self.budget_rm,
            "flexmoe_slots": self.flexmoe_slots, "reshard_interval": self.reshard_interval,
            "smartmoe_interval": self.smartmoe_interval, "flexmoe_threshold": self.flexmoe_threshold,
            "calibration": self.calibration, "calibration_budget_attn": self.calibration_budget,
            "dense_params": self.dense_params, "extra_compute_ms": 1e3 * self.extra_compute_s,
            "side_ratio": self.side_ratio, "zero_stage": self.zero_stage, "gas": self.gas, "hardware": asdict(self.hw)
        }


def sim_settings(name: str, setup: Setup, *, budget: int, by_window: bool, t_by_time: bool = True,
                 overlap_degree: int | None = None, placement: str = "paper", dispatch: str = "paper",
                 dispatch_slack: float = 0.0) -> PlannerSettings:
    """The planner settings a simulated policy runs with (``planner.inputs.planner_inputs`` builds
    its inputs, as the runtime's from its config): ``by_window``: t from each layer's window (the
    runtime's "auto"; else ``overlap_degree``, default the setup's, fixed), searched by time under
    ``t_by_time``;
    calibration's latency budget ``calibration_budget`` attention forwards. The setup's
    ``reshard_interval`` is FSSDP's: the baselines run as published (DeepSpeed's EP, FSMoE and the
    others never run Algorithm 2), a runtime run of theirs with ``reshard_interval`` 0."""
    fssdp = name in ("fssdp", "fssdp-rm")
    t = setup.overlap_degree if overlap_degree is None else int(overlap_degree)
    return PlannerSettings(policy=name, budget=int(budget), overlap_degree="auto" if by_window else t,
                           calibration=setup.calibration,
                           calibration_latency_budget=setup.calibration_budget * setup.attention_fwd_s,
                           placement=placement, reshard_interval=setup.reshard_interval if fssdp else 0,
                           smartmoe_interval=setup.smartmoe_interval, dispatch=dispatch,
                           dispatch_slack=float(dispatch_slack), t_by_time=t_by_time,
                           flexmoe_threshold=setup.flexmoe_threshold, flexmoe_slots=setup.flexmoe_slots,
                           flexmoe_interval=setup.flexmoe_interval)


def derive_overlap_degree(hw: Hardware, topology: Topology, shape: ExpertShape, *, attention_s: float) -> int:
    """t for an attention of ``attention_s``: the one t function, :meth:`CostModel.overlap_degree`."""
    return CostModel(hw, shape, topology).overlap_degree(attention_s)


def build_setup(cluster: ClusterPreset, model: ModelPreset, gpus: int, *, tokens_per_gpu: int | None = None,
                replica_memory_bytes: float | None = None, overlap_degree: int | None = None,
                budget: int | None = None, budget_rm: int | None = None, flexmoe_slots: int | None = None,
                **options) -> Setup:
    """A :class:`Setup` from presets; ``options`` are the remaining :class:`Setup` fields."""
    G = cluster.ranks_per_node
    if gpus < 1 or (gpus > G and gpus % G):
        raise ValueError(f"gpus ({gpus}) must be >= 1 and, beyond one node, a multiple of {G} GPUs per node")
    topology = Topology(num_ranks=gpus, ranks_per_node=min(G, gpus))
    hw, shape, L, E = cluster.hardware(), model.expert_shape(), model.num_layers(cluster.name), model.num_experts(gpus)
    tokens = model.tokens_per_gpu(cluster) if tokens_per_gpu is None else tokens_per_gpu
    if tokens < 1:
        raise ValueError(f"tokens_per_gpu ({tokens}) must be >= 1")
    memory = cluster.replica_memory_bytes if replica_memory_bytes is None else replica_memory_bytes
    if memory < 0:
        raise ValueError(f"replica_memory_bytes ({memory}) must be >= 0")
    attention_s = tokens * model.attention_flops_per_token() / hw.flops
    t = overlap_degree if overlap_degree is not None else derive_overlap_degree(hw, topology, shape,
                                                                                attention_s=attention_s)
    m, m_rm = (given if given is not None else auto_materialization_budget(
        memory_bytes=int(memory), expert_bytes=shape.expert_bytes, num_layers=L, rematerialize=rm)
        for given, rm in ((budget, False), (budget_rm, True)))
    full_state = (PARAM_BYTES + GRAD_BYTES + OPT_BYTES) * shape.params
    slots = flexmoe_slots if flexmoe_slots is not None else max(1, int(memory // (full_state * L)))
    label = options.pop("label", f"cluster {cluster.name.upper()}, {model.name}, {gpus} GPUs")
    return Setup(topology=topology, hw=hw, shape=shape, num_layers=L, num_experts=E, tokens_per_gpu=tokens,
                 attention_flops_per_token=model.attention_flops_per_token(),
                 dense_params=L * model.dense_params_per_layer(E) + model.extra_dense_params(), overlap_degree=t,
                 budget=m, budget_rm=m_rm, flexmoe_slots=slots, label=label, top_k=model.top_k,
                 extra_compute_s=3.0 * tokens * model.extra_flops_per_token() / hw.flops, hbm_bytes=cluster.hbm_bytes,
                 side_ratio=model.side_ratio, **options)
