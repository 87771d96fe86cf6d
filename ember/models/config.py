"""``ModelConfig``: the frozen description of a decoder-only language model.

A config holds the **architecture** (what the parameters mean) and a few **runtime**
settings (:data:`RUNTIME_FIELDS`: kernel ``attention_impl``, ``moe_impl`` and ``quantized_impl``,
``remat``, ``scan_layers``, ``page_size``, compute ``precision``) that a checkpoint does not depend on.

One config builds the model (``DecoderLM(config)``), its cache (``init_cache_layers``), its
FLOPs estimate and its Hugging Face mapping. Presets live in ``configs/models/*.yaml``:

    config = load_config(ModelConfig, "configs/models/tiny.yaml", ["num_layers=4"])
    wider = dataclasses.replace(config, d_model=128)

Layer kinds (``block_pattern``, repeated cyclically over ``num_layers``):

- ``global``: causal softmax (or sigmoid) attention over the whole prefix.
- ``local``: causal attention within ``sliding_window`` tokens.
- ``block_sparse``: causal attention within ``sliding_window`` tokens plus the first
  ``global_tokens`` tokens of the sequence -- of each document, in rows of packed documents
  (local + global, Longformer/BigBird style); the kernel skips the blocks no query sees.
- ``cca``: Compressed Convolutional Attention in a latent space ``cca_compression`` times
  narrower than the model (CCGQA when ``cca_kv_heads < cca_heads``).
- ``linear``: linear attention with the ``linear_feature_map`` feature map.
- ``window_linear``: a linearised softmax layer (LoLCATs): exact softmax attention over the
  last ``sliding_window`` tokens plus linear attention (``linear_feature_map``, Hedgehog when
  linearising) over every earlier token, sharing one normaliser, with a learned per-head mix;
  its cache is an O(window) state slot per sequence (see ``layers/window_linear_math.py``).
- ``mamba2``: the Mamba-2 mixer (``ssm``, an :class:`SSMConfig`): input projections, a
  causal depthwise convolution, the SSD scan, a gated per-group RMSNorm. Mamba-2 models set
  ``mlp_pattern: [none]``; hybrids mix it with the attention kinds (e.g. ``[mamba2, mamba2,
  mamba2, global]``). Its cache is an O(1) state slot per sequence.

MLP placement (``mlp_pattern``, repeated cyclically over ``num_layers`` like the block
pattern): ``dense`` (the ``mlp`` feed-forward block), ``moe`` (a mixture of experts
described by ``moe``, a :class:`MoEConfig`) or ``none`` (the block is the mixer alone).
Layer ``i`` has mixer ``block_pattern[i % len(block_pattern)]`` and MLP
``mlp_pattern[i % len(mlp_pattern)]``; the layers repeat with period
:attr:`ModelConfig.layer_period`, the least common multiple of the two lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ember.core.errors import ConfigError
from ember.core.precision import Precision
from ember.kernels_pallas.dispatch import IMPLS

LAYER_KINDS: tuple[str, ...] = ("global", "local", "block_sparse", "cca", "linear", "mamba2", "window_linear")
SOFTMAX_FAMILY: tuple[str, ...] = ("global", "local", "block_sparse")
"""Kinds that run the ordinary multi-head attention module over a paged KV cache."""
ROTARY_KINDS: tuple[str, ...] = (*SOFTMAX_FAMILY, "cca", "window_linear")
"""Kinds that apply rotary embeddings (their head size must be even)."""
MLP_KINDS: tuple[str, ...] = ("swiglu", "geglu", "gelu", "relu")
MLP_PLACEMENTS: tuple[str, ...] = ("dense", "moe", "none")
"""What follows a layer's mixer (``mlp_pattern`` entries)."""
NORM_KINDS: tuple[str, ...] = ("rmsnorm", "layernorm")
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3")
SCORE_KINDS: tuple[str, ...] = ("softmax", "sigmoid")
FEATURE_MAPS: tuple[str, ...] = ("elu", "relu", "hedgehog")
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots", "dots_no_batch")
QUANTIZED_IMPLS: tuple[str, ...] = tuple(impl for impl in IMPLS if impl != "interpret_tpu")
"""``quantized_impl`` values: what ``quantized_matmul`` accepts (it has no TPU kernel to interpret)."""
RUNTIME_CHOICES: dict[str, tuple[str, ...]] = {
    "attention_impl": IMPLS,
    "moe_impl": IMPLS,
    "quantized_impl": QUANTIZED_IMPLS,
    "remat": REMAT_POLICIES,
}
"""The runtime fields that name one of a few choices, and their choices."""
RUNTIME_FIELDS: frozenset[str] = frozenset(
    {
        "attention_impl",
        "moe_impl",
        "quantized_impl",
        "remat",
        "scan_layers",
        "page_size",
        "precision",
        "attention_transfer",
        "transfer_pattern",
        "transfer_window",
    }
)
"""Fields that say how a process runs the model, not what its parameters mean: a checkpoint
may be resumed or served with any of them changed (``precision`` only while its parameter
dtype stays the same; see :meth:`ModelConfig.architecture`)."""


def runtime_overrides(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`RUNTIME_FIELDS` that ``settings`` (a fine-tuning run's ``base_model`` section, as
    a dict) sets for the model it loads: an empty value (``""`` or None) keeps the model's own."""
    return {name: value for name, value in settings.items() if name in RUNTIME_FIELDS and value not in ("", None)}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding and its context-extension scaling.

    ``scaling``: ``none``; ``linear`` (positions divided by ``factor``); ``llama3``
    (frequencies below ``original_max_len / low_freq_factor`` wavelengths divided by
    ``factor``, high ones kept, smooth in between — Llama 3.1).
    """

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        _check_choice("rope.scaling", self.scaling, ROPE_SCALINGS)
        if self.theta <= 0:
            raise ConfigError(f"rope.theta must be positive, got {self.theta}", key="rope.theta")
        if self.scaling != "none" and self.factor <= 0:
            raise ConfigError(f"rope.factor must be positive, got {self.factor}", key="rope.factor")
        if self.scaling == "llama3" and self.original_max_len < 1:
            raise ConfigError(
                f"rope.original_max_len must be a positive number of positions for llama3 scaling, got "
                f"{self.original_max_len}",
                key="rope.original_max_len",
            )
        if self.scaling == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                f"rope.high_freq_factor ({self.high_freq_factor}) must exceed rope.low_freq_factor "
                f"({self.low_freq_factor}) > 0 for llama3 scaling",
                key="rope.low_freq_factor",
            )


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture of experts of every ``moe`` layer (``mlp_pattern``).

    Routing: router logits ``x @ router [embed, experts]`` in f32 (plus, with
    ``gating_residual``, a learned projection of the previous MoE layer's logits: MoE++);
    scores ``softmax`` or ``sigmoid`` of them; the ``top_k`` highest scores (plus the
    ``balance`` bias with ``bias_balancing_rate``, for the choice only) pick the experts; their
    scores, divided by their sum when ``renormalize`` (Mixtral: yes, Qwen2-MoE: no, Qwen3-MoE:
    its ``norm_topk_prob``), times ``routed_scaling``, weight the expert outputs.

    - ``expert_dim``: hidden width of one expert; 0 means the model's ``mlp_dim``.
    - ``capacity_factor``: 0 is dropless; otherwise each expert takes at most
      ``ceil(capacity_factor * tokens * top_k / num_experts)`` token-slots per forward pass,
      first choices before second ones, each in token order; the rest are dropped. ``tokens``
      counts the real ones: padding (segment id 0, a serving step's unused budget) is routed
      to no expert, so a padded batch computes what the same documents packed without padding
      do. A serving step's capacity comes from its own real tokens too: a decode step of a few
      sequences has a slot or two per expert and drops what more of its tokens choose (the
      Mixtral, Qwen2-MoE and Qwen3-MoE imports are dropless).
    - ``shared_experts`` (of ``shared_expert_dim`` each, 0 = ``expert_dim``): always-on
      experts, one MLP of ``shared_experts * shared_expert_dim`` channels, scaled by
      ``sigmoid(x @ shared_gate)`` when ``shared_expert_gate`` (Qwen2-MoE).
    - ``first_dense_layers``: layers ``[0, k)`` are ``dense`` whatever ``mlp_pattern`` says
      (DeepSeek); needs ``scan_layers=false``.
    - MoE++ zero-computation experts, routed like the others after the ``num_experts`` FFN
      experts: ``num_zero_experts`` (output 0), ``num_copy_experts`` (output x),
      ``num_constant_experts`` (``a x + b v`` with a learned vector ``v`` and ``(a, b)`` a
      softmax of a learned projection of ``x``).
    - ``bias_balancing_rate``: DeepSeek-V3 auxiliary-loss-free balancing: a per-expert bias
      (Linen collection ``balance``, ``router_bias``) added to the scores for the choice of
      experts only, updated when that collection is mutable by
      ``rate * sign(mean load - load)``. 0 = off (no ``balance`` collection).
    """

    num_experts: int = 8
    top_k: int = 2
    expert_dim: int = 0
    score: str = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0
    capacity_factor: float = 0.0
    shared_experts: int = 0
    shared_expert_dim: int = 0
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    num_zero_experts: int = 0
    num_copy_experts: int = 0
    num_constant_experts: int = 0
    gating_residual: bool = False
    bias_balancing_rate: float = 0.0

    def __post_init__(self):
        if self.num_experts < 1:
            raise ConfigError(f"moe.num_experts must be >= 1, got {self.num_experts}", key="moe.num_experts")
        if not 1 <= self.top_k <= self.total_experts:
            raise ConfigError(
                f"moe.top_k must be in [1, {self.total_experts}] (the routed experts, zero-computation ones "
                f"included), got {self.top_k}",
                key="moe.top_k",
            )
        for name in (
            "expert_dim", "shared_experts", "shared_expert_dim", "first_dense_layers",
            "num_zero_experts", "num_copy_experts", "num_constant_experts",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(f"moe.{name} must be >= 0, got {getattr(self, name)}", key=f"moe.{name}")
        _check_choice("moe.score", self.score, SCORE_KINDS)
        for name in ("capacity_factor", "bias_balancing_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"moe.{name} must be >= 0 (0 = off), got {getattr(self, name)}", key=f"moe.{name}")
        if self.routed_scaling <= 0:
            raise ConfigError(
                f"moe.routed_scaling must be positive, got {self.routed_scaling}", key="moe.routed_scaling"
            )
        if self.shared_expert_gate and not self.shared_experts:
            raise ConfigError("moe.shared_expert_gate needs moe.shared_experts >= 1", key="moe.shared_expert_gate")

    @property
    def total_experts(self) -> int:
        """Routed experts: the FFN experts then the zero, copy and constant ones."""
        return self.num_experts + self.num_zero_experts + self.num_copy_experts + self.num_constant_experts


@dataclasses.dataclass(frozen=True)
class SSMConfig:
    """The Mamba-2 mixer of ``mamba2`` layers (names as Hugging Face's ``Mamba2Config``).

    The inner width is ``expand * d_model``, split into ``expand * d_model // head_dim``
    heads; ``B``/``C`` have ``n_groups`` groups of ``state_size`` (shared by the heads of a
    group; the gated norm also normalises per group). ``conv_kernel`` taps of causal
    depthwise convolution over ``x, B, C``; ``chunk_size`` is the SSD chunk (a power of two
    >= 8; results do not depend on it). The step size ``dt = softplus(dt + dt_bias)`` is
    clamped to ``time_step_limit`` (``(0, inf)``: no clamp).
    """

    state_size: int = 16
    n_groups: int = 1
    expand: int = 2
    head_dim: int = 16
    conv_kernel: int = 4
    chunk_size: int = 64
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    use_conv_bias: bool = True

    def __post_init__(self):
        for name in ("state_size", "n_groups", "expand", "head_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                key = f"ssm.{name}"
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, name)}", key=key)
        if self.chunk_size < 8 or self.chunk_size & (self.chunk_size - 1):
            raise ConfigError(
                f"ssm.chunk_size must be a power of two >= 8, got {self.chunk_size}", key="ssm.chunk_size"
            )
        limit = tuple(float(v) for v in self.time_step_limit)
        if len(limit) != 2 or not 0 <= limit[0] < limit[1]:
            raise ConfigError(
                f"ssm.time_step_limit must be [low, high] with 0 <= low < high, got {list(self.time_step_limit)}",
                key="ssm.time_step_limit",
            )
        object.__setattr__(self, "time_step_limit", limit)

    def heads(self, d_model: int) -> int:
        """SSM heads of a ``d_model`` model: ``expand * d_model // head_dim``."""
        return self.expand * d_model // self.head_dim

    def conv_dim(self, d_model: int) -> int:
        """Channels of the convolution (and of its state): ``x``, ``B`` and ``C``."""
        return self.expand * d_model + 2 * self.n_groups * self.state_size


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM. ``head_dim``/``num_kv_heads`` of 0 mean ``d_model // num_heads`` /
    ``num_heads``; ``attn_soft_cap``/``final_soft_cap`` of 0 mean no soft-cap; ``attn_scale``
    of 0 means ``1 / sqrt(head_dim)``; ``local_rope_theta`` of 0 means ``rope`` on every layer."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 0
    head_dim: int = 0
    mlp_dim: int = 256
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    attn_soft_cap: float = 0.0
    final_soft_cap: float = 0.0
    attn_scale: float = 0.0
    """What softmax attention (and ``window_linear``'s window) multiplies ``q . k`` by (Gemma 2/3:
    ``query_pre_attn_scalar ** -0.5``); layers without such scores (linear, Mamba-2) have no use
    for it, CCA refuses it."""
    embed_scale: float = 1.0
    """What the token embeddings are multiplied by, in the compute dtype (Gemma: ``sqrt(d_model)``);
    a tied output head reads the embedding table unscaled."""
    post_norms: bool = False
    """Each block also normalises its mixer's and its MLP's output before adding it to the residual
    (``attn_post_norm``, ``mlp_post_norm``: Gemma 2/3's "sandwich" norms)."""
    local_rope_theta: float = 0.0
    """The rotary base of ``local`` layers, unscaled (Gemma 3's ``rope_local_base_freq``)."""
    score: str = "softmax"
    block_pattern: tuple[str, ...] = ("global",)
    mlp_pattern: tuple[str, ...] = ("dense",)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    sliding_window: int = 4096
    global_tokens: int = 64
    cca_compression: int = 2
    cca_heads: int = 0
    cca_kv_heads: int = 0
    cca_conv_width: int = 2
    linear_feature_map: str = "elu"
    linear_feature_dim: int = 0
    ssm: SSMConfig = dataclasses.field(default_factory=SSMConfig)
    init_std: float = 0.02
    precision: str = "f32"
    scan_layers: bool = True
    remat: str = "none"
    attention_impl: str = "auto"
    moe_impl: str = "auto"
    quantized_impl: str = "auto"
    """Runtime: the ``impl`` of the quantized matmul every stored-quantized weight runs
    (``ember.models.quantization``: a quantized model, QLoRA's frozen base), one of
    :data:`QUANTIZED_IMPLS`; ``auto`` runs the Pallas kernel on a GPU and XLA elsewhere."""
    page_size: int = 16
    attention_transfer: bool = False
    """Runtime, for linearising (stage 1): every ``window_linear`` layer sows the squared error of
    its output against the softmax attention it replaces (``losses``, ``attention_transfer``)
    and passes the softmax output on, so one forward trains every layer's feature maps."""
    transfer_pattern: tuple[str, ...] = ()
    """Runtime, with ``attention_transfer``: the teacher's ``block_pattern``, so each
    ``window_linear`` layer's target is the softmax attention kind it replaced (``local`` and
    ``block_sparse`` within ``transfer_window`` tokens); empty: ``global`` for every layer."""
    transfer_window: int = 0
    """Runtime, with ``attention_transfer``: the teacher's ``sliding_window`` (0: ``sliding_window``)."""

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len", "page_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)
        for name in ("num_kv_heads", "head_dim", "cca_heads", "cca_kv_heads", "linear_feature_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = derived default), got {getattr(self, name)}", key=name)
        _check_choice("mlp", self.mlp, MLP_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        _check_choice("score", self.score, SCORE_KINDS)
        _check_choice("linear_feature_map", self.linear_feature_map, FEATURE_MAPS)
        for name, allowed in RUNTIME_CHOICES.items():
            _check_choice(name, getattr(self, name), allowed)
        if not self.block_pattern:
            raise ConfigError("block_pattern must name at least one layer kind", key="block_pattern")
        for kind in self.block_pattern:
            _check_choice("block_pattern", kind, LAYER_KINDS)
        if not self.mlp_pattern:
            raise ConfigError("mlp_pattern must name at least one MLP placement", key="mlp_pattern")
        for placement in self.mlp_pattern:
            _check_choice("mlp_pattern", placement, MLP_PLACEMENTS)
        if self.head_dim == 0 and self.d_model % self.num_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}) unless head_dim is set",
                key="head_dim",
            )
        if self.kv_heads > self.num_heads or self.num_heads % self.kv_heads:
            raise ConfigError(
                f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})", key="num_kv_heads"
            )
        if self.scan_layers and self.num_layers % self.layer_period:
            raise ConfigError(
                f"scan_layers needs num_layers ({self.num_layers}) to be a multiple of the layer period "
                f"({self.layer_period}: the least common multiple of the block_pattern and mlp_pattern "
                "lengths); set scan_layers=false or change the patterns",
                key="num_layers",
            )
        if not self.norm_eps >= 0:  # a negative epsilon takes the square root of a negative variance: NaN
            raise ConfigError(f"norm_eps must be >= 0, got {self.norm_eps}", key="norm_eps")
        for cap in ("attn_soft_cap", "final_soft_cap"):  # cap * tanh(x / cap) is NaN for an infinite cap
            value = getattr(self, cap)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{cap} must be a finite number >= 0 (0 = off), got {value}", key=cap)
        for name, default in (("attn_scale", "1 / sqrt(head_dim)"), ("local_rope_theta", "rope.theta")):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number >= 0 (0 = {default}), got {value}", key=name)
        if self.attn_scale and "cca" in self.block_pattern:
            raise ConfigError(
                "attn_scale scales the scores of softmax attention and window_linear layers; a cca layer's "
                "scores are scaled by 1 / sqrt(head_dim) and would ignore it",
                key="attn_scale",
            )
        if not (self.embed_scale > 0 and math.isfinite(self.embed_scale)):
            raise ConfigError(f"embed_scale must be a finite number > 0, got {self.embed_scale}", key="embed_scale")
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}", key="sliding_window")
        if self.global_tokens < 0:
            raise ConfigError(f"global_tokens must be >= 0, got {self.global_tokens}", key="global_tokens")
        if "cca" in self.block_pattern:
            self._check_cca()
        if "window_linear" in self.block_pattern and self.score != "softmax":
            raise ConfigError(
                f"window_linear layers take softmax scores (they linearise softmax attention), got {self.score!r}",
                key="score",
            )
        if self.transfer_pattern:
            self._check_transfer_pattern()
        if "mamba2" in self.block_pattern:
            self._check_ssm()
        if self.head_size % 2 and set(self.block_pattern) & set(ROTARY_KINDS):
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_size}", key="head_dim")
        if self.moe.first_dense_layers and self.scan_layers:
            raise ConfigError(
                "moe.first_dense_layers needs scan_layers=false (the first layers differ from the scanned "
                "period); or write the dense layers into mlp_pattern",
                key="moe.first_dense_layers",
            )
        try:
            Precision.from_string(self.precision)
        except ValueError as error:
            raise ConfigError(str(error), key="precision") from None

    def _check_cca(self) -> None:
        if self.cca_compression < 1 or self.d_model % self.cca_compression:
            raise ConfigError(
                f"cca_compression ({self.cca_compression}) must be a positive divisor of d_model ({self.d_model})",
                key="cca_compression",
            )
        latent = self.d_model // self.cca_compression
        if latent % self.cca_query_heads or (latent // self.cca_query_heads) % 2:
            raise ConfigError(
                f"the CCA latent width d_model / cca_compression = {latent} must split into cca_heads "
                f"({self.cca_query_heads}) heads of even size",
                key="cca_heads",
            )
        if self.cca_query_heads % self.cca_key_value_heads:
            raise ConfigError(
                f"cca_kv_heads ({self.cca_key_value_heads}) must divide cca_heads ({self.cca_query_heads})",
                key="cca_kv_heads",
            )
        if self.cca_conv_width < 1:
            raise ConfigError(f"cca_conv_width must be >= 1, got {self.cca_conv_width}", key="cca_conv_width")

    def _check_ssm(self) -> None:
        ssm = self.ssm
        inner = ssm.expand * self.d_model
        if inner % ssm.head_dim:
            raise ConfigError(
                f"ssm.head_dim ({ssm.head_dim}) must divide the inner width ssm.expand * d_model = {inner}",
                key="ssm.head_dim",
            )
        if ssm.heads(self.d_model) % ssm.n_groups:
            raise ConfigError(
                f"ssm.n_groups ({ssm.n_groups}) must divide the SSM heads ({ssm.heads(self.d_model)})",
                key="ssm.n_groups",
            )

    # Derived sizes. Properties (not fields) so that ``replace`` keeps them consistent.
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def rope_of(self, kind: str) -> RopeConfig:
        """The rotary embedding of a ``kind`` layer: ``rope``, or for a ``local`` one with
        ``local_rope_theta`` set, the unscaled rotation of that base."""
        if kind == "local" and self.local_rope_theta:
            return RopeConfig(theta=self.local_rope_theta)
        return self.rope

    @property
    def cca_query_heads(self) -> int:
        """CCA query heads; by default as many as fit the latent width at ``head_size``."""
        return self.cca_heads or max(1, self.d_model // self.cca_compression // self.head_size)

    @property
    def cca_key_value_heads(self) -> int:
        return self.cca_kv_heads or self.cca_query_heads

    @property
    def cca_head_size(self) -> int:
        return self.d_model // self.cca_compression // self.cca_query_heads

    def _check_transfer_pattern(self) -> None:
        if len(self.transfer_pattern) != len(self.block_pattern):
            raise ConfigError(
                f"transfer_pattern (the teacher's block_pattern) must have one kind per block_pattern entry "
                f"({len(self.block_pattern)}), got {list(self.transfer_pattern)}",
                key="transfer_pattern",
            )
        for kind, teacher in zip(self.block_pattern, self.transfer_pattern):
            if kind == "window_linear" and teacher not in SOFTMAX_FAMILY:
                raise ConfigError(
                    f"transfer_pattern: a window_linear layer replaced one of {', '.join(SOFTMAX_FAMILY)}, "
                    f"got {teacher!r}",
                    key="transfer_pattern",
                )
        if self.transfer_window < 0:
            raise ConfigError(
                f"transfer_window must be >= 0 (0 = sliding_window), got {self.transfer_window}", key="transfer_window"
            )

    @property
    def layer_transfer_kinds(self) -> tuple[str, ...]:
        """The attention-transfer target kind of every layer, ``transfer_pattern`` repeated over
        ``num_layers`` (``global`` without one)."""
        pattern = self.transfer_pattern or ("global",)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))

    @property
    def layer_period(self) -> int:
        """Layers after which both patterns repeat: the blocks of one scanned group."""
        return math.lcm(len(self.block_pattern), len(self.mlp_pattern))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The mixer kind of every layer, ``block_pattern`` repeated over ``num_layers``."""
        period = len(self.block_pattern)
        return tuple(self.block_pattern[i % period] for i in range(self.num_layers))

    @property
    def layer_mlps(self) -> tuple[str, ...]:
        """The MLP placement of every layer, ``mlp_pattern`` repeated over ``num_layers``."""
        period, first_dense = len(self.mlp_pattern), self.moe.first_dense_layers
        return tuple("dense" if i < first_dense else self.mlp_pattern[i % period] for i in range(self.num_layers))

    @property
    def expert_dim(self) -> int:
        return self.moe.expert_dim or self.mlp_dim

    @property
    def policy(self) -> Precision:
        return Precision.from_string(self.precision)

    def architecture(self) -> dict[str, object]:
        """What the parameters mean: every field except :data:`RUNTIME_FIELDS`, plus
        ``precision`` reduced to the parameter dtype (compute/output dtypes are runtime).
        Two configs with equal architectures load each other's checkpoints."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in RUNTIME_FIELDS}
        fields["rope"] = dataclasses.asdict(self.rope)
        fields["moe"] = dataclasses.asdict(self.moe)
        fields["ssm"] = dataclasses.asdict(self.ssm)
        fields["precision"] = f"params={self.policy.param_dtype.name}"
        return fields


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}", key=name)


__all__ = [
    "FEATURE_MAPS",
    "LAYER_KINDS",
    "MLP_KINDS",
    "MLP_PLACEMENTS",
    "QUANTIZED_IMPLS",
    "ROTARY_KINDS",
    "RUNTIME_CHOICES",
    "RUNTIME_FIELDS",
    "SOFTMAX_FAMILY",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "SSMConfig",
    "runtime_overrides",
]
