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

Fixed presets (``FIXED_MODELS``: the real models, whose expert count does not grow with the
cluster; shapes from their Hugging Face configs, ``transformers``' ``MixtralConfig``,
``Qwen3MoeConfig``, ``DeepseekV3Config``): every layer of the whole model on every rank (no
pipeline stage), sequences of 4096 tokens. Attention counts its real projections (GQA for Mixtral
and Qwen3, MLA for DeepSeek-V3) in ``attention_params`` and its score width in ``attention_dim``
(heads x head dim; MLA: heads x the mean of the query-key and value head dims). DeepSeek-V3's
shared expert and its three dense first layers (FFN 18432) are counted: the dense layers' compute,
identical under every policy, in every iteration; the shared expert's in its layer, as the work
beside the exchange (``side_ratio``: one expert row per token; ``sim/pipeline.py``); their
parameters with the dense part. Embeddings and LM
head are left out as above.
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
    experts: int = 0  # a fixed expert count (the real models); 0: experts_per_gpu x GPUs
    shared_experts: int = 0  # counted only for fixed presets (see the module docstring)
    dense_layers: int = 0  # leading layers with a dense FFN of dense_ffn instead of experts
    dense_ffn: int = 0
    attention_params: int = 0  # weights of one attention block; 0: 4 d^2
    attention_dim: int = 0  # score width; 0: d_model

    @property
    def fixed(self) -> bool:
        return self.experts > 0

    def num_layers(self, cluster: str) -> int:
        """MoE layers (the dense first layers are not among them)."""
        return self.layers_a if cluster == "a" else self.layers_b

    def num_experts(self, gpus: int) -> int:
        return self.experts if self.fixed else self.experts_per_gpu * gpus

    def activation_bytes_per_token(self, cluster: str) -> float:
        d = self.d_model
        per_layer = 34.0 * d + (self.top_k + self.shared_experts) * 2.0 * (2 * d + self.matrices * self.d_ffn)
        dense = self.dense_layers * (34.0 * d + 2.0 * (2 * d + 3 * self.dense_ffn))
        return per_layer * self.num_layers(cluster) + dense

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
        return 2.0 * self.attention_weights + 2.0 * self.seq_len * (self.attention_dim or self.d_model)

    @property
    def attention_weights(self) -> int:
        return self.attention_params or 4 * self.d_model * self.d_model

    def dense_params_per_layer(self, num_experts: int) -> int:
        """Attention projections, the gate, two LayerNorms (weight + bias), the shared experts."""
        d = self.d_model
        return self.attention_weights + d * num_experts + 4 * d + self.shared_experts * self.expert_shape().params

    def extra_dense_params(self) -> int:
        """The dense first layers: attention, SwiGLU FFN, norms."""
        return self.dense_layers * (self.attention_weights + 3 * self.d_model * self.dense_ffn + 4 * self.d_model)

    def extra_flops_per_token(self) -> float:
        """Forward FLOPs per token that every policy spends alike beyond the MoE layers: the dense
        first layers."""
        dense = self.dense_layers * (self.attention_flops_per_token() + 2.0 * 3 * self.d_model * self.dense_ffn)
        return dense if self.fixed else 0.0

    @property
    def side_ratio(self) -> float:
        """A MoE layer's shared experts per token, in expert rows (each of ``d_ffn``, as the
        routed ones): the work beside the exchange (0 for the paper's presets, which leave them out)."""
        return float(self.shared_experts) if self.fixed else 0.0


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

# Attention weights: Mixtral q/o 4096x4096, k/v 4096x1024 (8 KV heads of 128); Qwen3-30B-A3B q/o
# 2048x4096 (32 heads of 128), k/v 2048x512 (4 KV heads); DeepSeek-V3 MLA q_a 7168x1536, q_b
# 1536x(128x192), kv_a 7168x576, kv_b 512x(128x256), o (128x128)x7168.
FIXED_MODELS = {
    m.name: m
    for m in (
        ModelPreset(name="mixtral-8x7b", d_model=4096, d_ffn=14336, seq_len=4096, layers_a=32, layers_b=32,
                    experts_per_gpu=0, top_k=2, matrices=3, experts=8,
                    attention_params=2 * 4096 * 4096 + 2 * 4096 * 1024, attention_dim=4096),
        ModelPreset(name="qwen3-30b-a3b", d_model=2048, d_ffn=768, seq_len=4096, layers_a=48, layers_b=48,
                    experts_per_gpu=0, top_k=8, matrices=3, experts=128,
                    attention_params=2 * 2048 * 4096 + 2 * 2048 * 512, attention_dim=4096),
        ModelPreset(name="deepseek-v3-671b", d_model=7168, d_ffn=2048, seq_len=4096, layers_a=58, layers_b=58,
                    experts_per_gpu=0, top_k=8, matrices=3, experts=256, shared_experts=1, dense_layers=3,
                    dense_ffn=18432, attention_params=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                    + 128 * 128 * 7168, attention_dim=128 * 160),
    )
}
MODELS.update(FIXED_MODELS)


def cluster_preset(name: str) -> ClusterPreset:
    if name.lower() not in CLUSTERS:
        raise ValueError(f"cluster ({name!r}) must be one of {tuple(CLUSTERS)}")
    return CLUSTERS[name.lower()]


def model_preset(name: str) -> ModelPreset:
    if name.lower() not in MODELS:
        raise ValueError(f"model ({name!r}) must be one of {tuple(MODELS)}")
    return MODELS[name.lower()]
