"""The paper's two clusters (section 5.1) and the models of its Table 1, as simulator inputs.

Every number that the paper does not state is an assumption, named here:

* Achievable FLOP/s = dense bf16 peak x ``mfu`` (0.5 for both GPUs) for the expert GEMMs and the
  attention alike.
* Link speeds are per direction: NVSwitch 600 GB/s (A100) and 900 GB/s (H200) are bidirectional
  totals, so 300 and 450 GB/s each way per GPU; the node's network is 400 Gbps (p4de: 4 x 100 Gbps
  EFA) and 3200 Gbps (p5en), 50 and 400 GB/s each way per node. Collectives reach
  ``link_efficiency`` (0.8) of them. One latency (20 us) per collective.
* ``replica_memory_bytes``: memory a rank has left for placement (ephemeral replicas, FlexMoE's
  reserves) once the batch fills the rest; the paper sizes the batch at the OOM edge and gives no
  number. 10 % of HBM by default (``--replica-memory-gb``).
* Batch: the paper uses "the largest batch size that avoids OOM across all systems" without the
  numbers. Here: whole sequences of SeqLen per GPU filling ``ACTIVATION_FRACTION`` (a quarter) of
  HBM with activations, at 34 d bytes per token per layer for the attention block (Korthikanti
  et al. with flash attention) plus, per routed row (k per token), bf16 input, output and expert
  hidden activations, 2 (2 d + matrices x d_ffn) bytes. The other three quarters cover model
  states, the overloaded ranks' activation spikes under EP, and allocator slack. Override with
  ``--tokens-per-gpu``.
* Experts: E = E/GPU x GPUs (section 5.1, so E grows with the cluster); GPT-*-MoE experts are GELU
  FFNs (2 matrices), Phi-3.5, Qwen1.5 and DeepSeek-V3 experts SwiGLU (3 matrices). Shared experts
  (Qwen1.5, DeepSeek-V3) run on every rank with identical cost under every policy and are left
  out, as are the embeddings and LM head (DeepSeek-V3 is a pipeline stage in the paper). Attention
  is plain multi-head attention of d_model (no GQA / MLA savings).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_fssdp.planner.cost import ExpertShape, Hardware

ACTIVATION_FRACTION = 0.25


@dataclass(frozen=True)
class ClusterPreset:
    name: str
    gpu: str
    ranks_per_node: int
    peak_flops: float  # dense bf16 FLOP/s per GPU
    intra_bw: float  # bytes/s per GPU per direction (nominal)
    inter_bw: float  # bytes/s per node per direction (nominal)
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    mfu: float = 0.5
    link_efficiency: float = 0.8
    latency: float = 20e-6

    @property
    def replica_memory_bytes(self) -> float:
        return 0.10 * self.hbm_bytes

    def hardware(self, *, inter_bw_scale: float = 1.0, intra_bw_scale: float = 1.0) -> Hardware:
        eff = self.link_efficiency
        return Hardware(flops=self.peak_flops * self.mfu, intra_bw=self.intra_bw * eff * intra_bw_scale,
                        inter_bw=self.inter_bw * eff * inter_bw_scale, latency=self.latency, hbm_bw=self.hbm_bw)


CLUSTERS = {
    "a": ClusterPreset(name="a", gpu="8 x A100-80G per node (AWS p4de.24xlarge)", ranks_per_node=8,
                       peak_flops=312e12, intra_bw=300e9, inter_bw=50e9, hbm_bw=2.0e12, hbm_bytes=80e9),
    "b": ClusterPreset(name="b", gpu="8 x H200-141G per node (AWS p5en.48xlarge)", ranks_per_node=8,
                       peak_flops=989e12, intra_bw=450e9, inter_bw=400e9, hbm_bw=4.8e12, hbm_bytes=141e9),
}


@dataclass(frozen=True)
class ModelPreset:
    """One row of Table 1 (plus the assumptions in the module docstring)."""

    name: str
    d_model: int
    d_ffn: int
    seq_len: int
    layers_a: int
    layers_b: int
    experts_per_gpu: int
    top_k: int
    matrices: int  # 2: GELU (w_a, w_b); 3: SwiGLU (w_gate, w_up, w_down)

    def num_layers(self, cluster: str) -> int:
        return self.layers_a if cluster == "a" else self.layers_b

    def num_experts(self, gpus: int) -> int:
        return self.experts_per_gpu * gpus

    def activation_bytes_per_token(self, cluster: str) -> float:
        d = self.d_model
        per_layer = 34.0 * d + self.top_k * 2.0 * (2 * d + self.matrices * self.d_ffn)
        return per_layer * self.num_layers(cluster)

    def tokens_per_gpu(self, cluster: "ClusterPreset") -> int:
        sequences = int(ACTIVATION_FRACTION * cluster.hbm_bytes // (self.activation_bytes_per_token(cluster.name) *
                                                                     self.seq_len))
        return max(1, sequences) * self.seq_len

    def expert_shape(self) -> ExpertShape:
        return ExpertShape(hidden=self.d_model, ffn=self.d_ffn, matrices=self.matrices)

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs of one token through one attention layer: QKV and output projections
        (4 d^2 weights, 2 FLOPs each) plus scores and weighted sum (2 x 2 S d, halved by the causal
        mask)."""
        d, s = self.d_model, self.seq_len
        return 8.0 * d * d + 2.0 * s * d

    def dense_params_per_layer(self, num_experts: int) -> int:
        """Attention projections, the gate, two LayerNorms (weight + bias)."""
        d = self.d_model
        return 4 * d * d + d * num_experts + 4 * d


MODELS = {
    m.name: m
    for m in (
        ModelPreset(name="gpt-s-moe", d_model=768, d_ffn=3072, seq_len=2048, layers_a=12, layers_b=12,
                    experts_per_gpu=2, top_k=2, matrices=2),
        ModelPreset(name="gpt-l-moe", d_model=1536, d_ffn=6144, seq_len=2048, layers_a=12, layers_b=12,
                    experts_per_gpu=2, top_k=2, matrices=2),
        ModelPreset(name="phi-3.5-moe", d_model=4096, d_ffn=6400, seq_len=4096, layers_a=4, layers_b=8,
                    experts_per_gpu=1, top_k=2, matrices=3),
        ModelPreset(name="qwen1.5-moe", d_model=2048, d_ffn=1408, seq_len=4096, layers_a=12, layers_b=24,
                    experts_per_gpu=2, top_k=4, matrices=3),
        ModelPreset(name="deepseek-v3", d_model=7168, d_ffn=2048, seq_len=4096, layers_a=2, layers_b=4,
                    experts_per_gpu=4, top_k=8, matrices=3),
    )
}


def cluster_preset(name: str) -> ClusterPreset:
    if name.lower() not in CLUSTERS:
        raise ValueError(f"cluster ({name!r}) must be one of {tuple(CLUSTERS)}")
    return CLUSTERS[name.lower()]


def model_preset(name: str) -> ModelPreset:
    if name.lower() not in MODELS:
        raise ValueError(f"model ({name!r}) must be one of {tuple(MODELS)}")
    return MODELS[name.lower()]
