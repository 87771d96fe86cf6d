"""FLOPs per token of a ``ModelConfig``, for MFU reporting.

Counts multiply-adds as 2 FLOPs, matmuls only (norms, activations, softmax and rotary are
a few percent and left out, as in the PaLM/Chinchilla MFU convention). Attention score
work counts the keys each query actually sees under its mask (causal, sliding window,
local + global), averaged over a sequence of ``seq_len``; training is 3x the forward pass
(backward = 2x forward).
"""

from __future__ import annotations

from ember.models.cache import linear_feature_dim
from ember.models.config import ModelConfig


def mean_visible_keys(config: ModelConfig, kind: str, seq_len: int) -> float:
    """Average number of keys a query attends to over a sequence of ``seq_len``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n, window, num_global = seq_len, config.sliding_window, config.global_tokens
    if kind in ("global", "cca"):
        return (n + 1) / 2
    local = sum(min(i + 1, window) for i in range(n))
    if kind in ("local", "window_linear"):
        return local / n
    if kind == "block_sparse":
        outside_window = sum(max(0, min(num_global, i - window + 1)) for i in range(n))
        return (local + outside_window) / n
    raise ValueError(f"no attention span for layer kind {kind!r}")


def mixer_flops(config: ModelConfig, kind: str, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's token mixer (projections + attention)."""
    d = config.d_model
    if kind == "cca":
        latent_q = config.cca_query_heads * config.cca_head_size
        latent_kv = config.cca_key_value_heads * config.cca_head_size
        width, head = config.cca_conv_width, config.cca_head_size
        projections = 2 * d * (latent_q + 2 * latent_kv) + 2 * latent_q * d
        convolutions = 2 * width * (latent_q + latent_kv) * (1 + head)
        return projections + convolutions + 4 * latent_q * mean_visible_keys(config, kind, seq_len)
    if kind == "mamba2":
        return _mamba2_flops(config)
    inner = config.num_heads * config.head_size
    if kind == "linear":
        features = linear_feature_dim(config)
        # State update k^T v and readout q S, per head, with the normaliser column.
        return 2 * d * 3 * inner + 2 * inner * d + 4 * config.num_heads * features * (config.head_size + 1)
    kv = config.kv_heads * config.head_size
    projections = 2 * d * (inner + 2 * kv) + 2 * inner * d
    attention = projections + 4 * inner * mean_visible_keys(config, kind, seq_len)
    if kind == "window_linear":  # plus the feature maps and the linear part beyond the window
        features = linear_feature_dim(config)
        hedgehog = config.linear_feature_map == "hedgehog"
        maps = 2 * config.head_size * (features // 2) * (config.num_heads + config.kv_heads) if hedgehog else 0
        return attention + maps + 4 * config.num_heads * features * (config.head_size + 1)
    return attention


def moe_flops(config: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE block: the router, ``top_k`` experts' MLPs (an upper
    bound with MoE++ zero-computation experts, which cost next to nothing) and the shared experts."""
    moe, d = config.moe, config.d_model
    matrices = 3 if config.mlp in ("swiglu", "geglu") else 2
    shared = moe.shared_experts * (moe.shared_expert_dim or config.expert_dim)
    router = 2 * d * moe.total_experts + (2 * moe.total_experts**2 if moe.gating_residual else 0)
    shared_gate = 2 * d if moe.shared_expert_gate else 0
    return router + 2 * matrices * d * (moe.top_k * config.expert_dim + shared) + shared_gate


def _mamba2_flops(config: ModelConfig) -> float:
    """Projections, the depthwise convolution and the chunked SSD scan per token: per head,
    the inter-chunk state update and readout (``2 P N`` multiply-adds each) and the
    intra-chunk scores ``C B^T`` and their product with ``x`` over the half chunk a token
    sees on average."""
    ssm, d = config.ssm, config.d_model
    heads, inner, conv_dim = ssm.heads(d), ssm.expand * d, ssm.conv_dim(d)
    projections = 2 * d * (inner + conv_dim + heads) + 2 * inner * d
    convolution = 2 * ssm.conv_kernel * conv_dim
    inter_chunk = 4 * heads * ssm.head_dim * ssm.state_size
    intra_chunk = heads * ssm.chunk_size * (ssm.state_size + ssm.head_dim)
    return projections + convolution + inter_chunk + intra_chunk


def flops_per_token(config: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token for sequences of ``seq_len`` (x3 when ``training``)."""
    matrices = 3 if config.mlp in ("swiglu", "geglu") else 2
    mlp = {"dense": 2 * matrices * config.d_model * config.mlp_dim, "moe": moe_flops(config), "none": 0}
    layers = sum(
        mixer_flops(config, kind, seq_len) + mlp[placement]
        for kind, placement in zip(config.layer_kinds, config.layer_mlps)
    )
    head = 2 * config.d_model * config.vocab_size
    forward = layers + head
    return 3 * forward if training else forward


__all__ = ["flops_per_token", "mean_visible_keys", "mixer_flops", "moe_flops"]
