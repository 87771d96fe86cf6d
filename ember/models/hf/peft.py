"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) <-> Ember adapters.

    save_peft_adapter("out/adapter", config, params, base_model="path/to/hf_model")
    params = with_adapter(base_params, load_peft_adapter("out/adapter", config))

What ``peft.PeftModel.from_pretrained(transformers_model, dir)`` reads: per adapted module
``<module>.lora_A.weight [r, in]``, ``<module>.lora_B.weight [out, r]`` and, with DoRA,
``<module>.lora_magnitude_vector [out]``, under ``base_model.model.``; the config gives
``r`` / ``lora_alpha`` (per module through ``rank_pattern`` / ``alpha_pattern``),
``use_rslora`` and ``use_dora``. Modules: the attention projections (``q_proj`` ...; Qwen3's
``q_norm`` / ``k_norm`` are not adapted), the dense MLP's and Qwen2-MoE's shared expert's
``gate_proj`` / ``up_proj`` / ``down_proj``.
Routed experts are not exchanged (PEFT targets them as fused parameters, a different layout).
An adapter with anything else (trained biases, ``modules_to_save``, LoRA on the embedding or
head, the options in :data:`PLAIN_LORA`) is refused, never loaded without its extra parts.

Saving writes every module's own alpha (``alpha = scale * r``, ``use_rslora`` false) so any
Ember scale round-trips, the adapters' dropout rate as ``lora_dropout``, and ``target_modules``
(with ``layers_to_transform`` for adapters on some layers) with which PEFT adapts exactly the
adapted modules; zero adapters (the padding of a scanned load) are not written. Loading refuses
factors for modules the config does not adapt, which PEFT would ignore. Adapters whose
initialisation changed the base weights (PiSSA, LoRA-GA: they carry ``lora_a0`` /
``lora_b0``) are saved against the ORIGINAL base as PEFT does for PiSSA: rank ``2r``, ``A' =
[A, A0]``, ``B' = [B; -B0]``, so that ``W_original + scale A' B' = W_residual + scale A B``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ember.core.errors import DataError, PathNotFoundError
from ember.core.sharding import unbox
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.leaves import adapted_paths, factors_on_original_base
from ember.models.adapters.lowrank import MIXLORA_ROUTER, part_name
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.hf.weights import check_all_used
from ember.models.layer_layout import layer_location, layers_from_list, layers_to_list

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
MODULES: dict[str, str] = {
    "attn/q/kernel": "self_attn.q_proj",
    "attn/k/kernel": "self_attn.k_proj",
    "attn/v/kernel": "self_attn.v_proj",
    "attn/o/kernel": "self_attn.o_proj",
    "mlp/gate": "mlp.gate_proj",
    "mlp/up": "mlp.up_proj",
    "mlp/down": "mlp.down_proj",
    "moe/shared/gate": "mlp.shared_expert.gate_proj",
    "moe/shared/up": "mlp.shared_expert.up_proj",
    "moe/shared/down": "mlp.shared_expert.down_proj",
}
"""Ember's per-layer weight path -> the HF module an adapter on it targets."""
ATTENTION_KINDS: tuple[str, ...] = (*SOFTMAX_FAMILY, "window_linear")
"""Layer kinds whose ``attn/{q,k,v,o}`` are softmax attention's projections (PEFT's
``self_attn.*_proj``); a Mamba-2 mixer's ``attn/o`` (HF's ``mixer.out_proj``), CCA's and linear
attention's projections have other shapes or meanings."""
_EMBER_PATH = {module: path for path, module in MODULES.items()}
PLAIN_LORA: dict[str, Any] = {
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "layer_replication": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
}
"""``adapter_config.json`` fields with which PEFT computes what Ember's LoRA does not (GPT-2's
Conv1D layout, trained biases, saved whole modules or token rows, replicated layers, LoRA on
raw parameters, aLoRA, QA-LoRA, BD-LoRA, Arrow, KaSA, MonteCLoRA), and their plain-LoRA value."""
BASE_CHANGING_INITS: tuple[str, ...] = ("pissa", "olora", "corda", "loftq")
"""``init_lora_weights`` values (``pissa_niter_<n>`` included) with which PEFT, loading the
adapter, first rewrites the base weights (PiSSA, OLoRA, CorDA: ``W - scale A0 B0``; LoftQ: a
quantized ``W``) and then adds the saved factors; on the original base they are another model."""


def save_peft_adapter(
    path: str | Path, config: ModelConfig, params: Mapping[str, Any], *, base_model: str | None = None
) -> None:
    """Writes the adapters of ``params`` as a PEFT LoRA adapter directory.

    Raises:
      DataError: ``params`` carries no adapters, or one PEFT cannot express (routed experts, the
        projections of a layer not in :data:`ATTENTION_KINDS`).
    """
    check_peft_exportable(config, params)
    layers = layers_to_list(config, unbox(params))
    tensors: dict[str, np.ndarray] = {}
    ranks, alphas, dora, dropouts = {}, {}, False, set()
    present = []  # each layer's modules of MODULES
    for index, layer in enumerate(layers):
        flat = param_paths(layer)
        present.append({MODULES[w] for w in flat if w in MODULES})
        for weight in adapted_paths(layer):
            module = _module_of(weight, config.layer_kinds[index])
            a, b = (np.asarray(factor, np.float32) for factor in factors_on_original_base(flat, weight))
            if not (a.any() or b.any() or part_name(weight, "lora_magnitude") in flat):
                continue  # the zero padding of a scanned load: changes nothing, and its gradients are zero
            scale = np.asarray(flat[part_name(weight, "lora_scale")], np.float32)
            rank = a.shape[-1]
            name = f"{PREFIX}{index}.{module}"
            tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
            tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)
            rate = np.float32(flat.get(part_name(weight, "lora_dropout"), 0.0))
            dropouts.add(float(str(rate)))  # the f32 leaf's shortest decimal: 0.05, not 0.05000000074505806
            magnitude = flat.get(part_name(weight, "lora_magnitude"))
            if magnitude is not None:
                dora = True
                tensors[name + ".lora_magnitude_vector"] = np.asarray(magnitude, np.float32).reshape(-1)
            ranks[f"model.layers.{index}.{module}"] = rank
            alphas[f"model.layers.{index}.{module}"] = float(scale) * rank
    if not tensors:
        raise DataError("the parameters carry no adapters to save")
    if dora and sum(n.endswith(".lora_magnitude_vector") for n in tensors) != len(ranks):
        raise DataError("PEFT needs DoRA on every adapted module or none; these adapters mix the two")
    if len(dropouts) > 1:
        raise DataError(f"PEFT has one lora_dropout for every module; these adapters use {sorted(dropouts)}")
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        **_target_fields(set(ranks), present),
        "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
        "alpha_pattern": {m: a for m, a in alphas.items() if a != alpha},
        "use_rslora": False,
        "use_dora": dora,
        "lora_dropout": dropouts.pop(),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def _target_fields(adapted: set[str], present: list[set[str]]) -> dict[str, Any]:
    """``target_modules`` (and ``layers_to_transform`` / ``layers_pattern``) with which PEFT puts
    an adapter on exactly the modules ``adapted`` (``model.layers.<i>.<module>``), no others:
    PEFT adapts every module of a listed name, on every layer unless ``layers_to_transform``
    says which. ``present[i]``: layer ``i``'s modules of :data:`MODULES`. Where names and layers
    cannot say it (modules adapted on different layers), the adapted modules' full names."""
    names = {module.rsplit(".", 1)[-1] for module in adapted}
    chosen = sorted({int(module.split(".")[2]) for module in adapted})
    covered = {
        f"model.layers.{index}.{module}"
        for index in chosen
        for module in present[index]
        if module.rsplit(".", 1)[-1] in names
    }
    if covered != adapted:
        return {"target_modules": sorted(adapted)}
    if len(chosen) == len(present):
        return {"target_modules": sorted(names)}
    return {"target_modules": sorted(names), "layers_to_transform": chosen, "layers_pattern": "layers"}


def check_peft_exportable(config: ModelConfig, params: Mapping[str, Any]) -> None:
    """Raises what :func:`save_peft_adapter` would for adapters PEFT cannot express, from the
    tree's paths alone (``params`` may be abstract, e.g. from ``jax.eval_shape``).

    Raises:
      DataError: MixLoRA experts, or an adapter on a weight with no PEFT module (routed experts, the
        projections of a layer not in :data:`ATTENTION_KINDS`).
    """
    if any(MIXLORA_ROUTER.match(p.rsplit("/", 1)[-1]) for p in param_paths(params)):
        raise DataError("MixLoRA's routed experts have no PEFT LoRA form; keep them as an Ember run")
    unboxed = unbox(params)
    for layer in range(config.num_layers):
        container, _, block = layer_location(config, layer)
        for weight in adapted_paths(unboxed[container][block]):
            _module_of(weight, config.layer_kinds[layer])


PEFT_DEFAULT_ALPHA = 8
"""``peft.LoraConfig``'s ``lora_alpha`` for an adapter_config.json that leaves it out."""
PEFT_DEFAULT_RANK = 8
"""``peft.LoraConfig``'s ``r`` for an adapter_config.json that leaves it out."""


def _unloadable(found: re.Match | None) -> str:
    """Why a PEFT module Ember has no adapter for is refused, and what to do, for the error."""
    if found is not None and found.group(2) == "mixer.in_proj":
        return (
            ": a LoRA on Mamba-2's fused in_proj is one low-rank update across its z, x, B, C and dt rows, "
            "which Ember keeps as separate projections, each with its own adapter; merge the adapter into "
            "the model with PEFT's merge_and_unload() and load the merged checkpoint"
        )
    return f" (it loads LoRA on model.layers.<i>.{{{', '.join(MODULES.values())}}})"


def load_peft_adapter(path: str | Path, config: ModelConfig, dtype: Any = np.float32) -> dict[str, Any]:
    """The adapter leaves (Ember layout for ``config``) of the PEFT LoRA directory ``path``.

    With ``scan_layers``, layers whose adapters differ in rank (``rank_pattern``) or that have
    none are padded with zero rows and columns to one stacked shape, which changes no output.

    Raises:
      PathNotFoundError: no adapter_config.json or adapter_model.safetensors.
      DataError: not a LoRA adapter, a PEFT option Ember does not implement (:data:`PLAIN_LORA`,
        :data:`BASE_CHANGING_INITS`), factors whose rank is not the config's ``r`` / ``rank_pattern``,
        tensors Ember would not use (for modules it does not have, biases, embeddings), or for modules
        that ``target_modules`` / ``layers_to_transform`` do not adapt (PEFT ignores them).
    """
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise PathNotFoundError(f"no {name} in {path} (a PEFT LoRA adapter directory has both)")
    try:
        peft_config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path / CONFIG_FILE} is not a JSON file ({error})") from None
    if peft_config.get("peft_type") != "LORA":
        raise DataError(f"{path} holds a {peft_config.get('peft_type')!r} adapter; Ember reads LORA adapters")
    for field, plain in PLAIN_LORA.items():
        if (peft_config.get(field) or plain) != plain:
            raise DataError(
                f"{path}: adapter_config.json has {field}={peft_config[field]!r}, which Ember does not implement; "
                f"it reads LoRA (rsLoRA, DoRA, per-module ranks and alphas) on attention and MLP projections "
                f"with {field}={plain!r}"
            )
    init = peft_config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise DataError(
            f"{path}: adapter_config.json has init_lora_weights={init!r}: PEFT rebuilds such an adapter's base by "
            "rewriting the original weights when it loads it, and its factors are relative to that base; save it "
            "with PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...) for a plain LoRA on "
            "the original weights, which Ember reads"
        )
    tensors = load_file(str(path / WEIGHTS_FILE))
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise DataError(f"{path}: adapter tensor {name!r} is missing")
        used.add(name)
        return tensors[name]

    layers: list[dict[str, Any]] = [{} for _ in range(config.num_layers)]
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight"):
            continue
        module_name = key[len("base_model.model.") : -len(".lora_A.weight")]
        found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module_name)
        if found is None or found.group(2) not in _EMBER_PATH or int(found.group(1)) >= config.num_layers:
            raise DataError(f"{path}: adapter tensor {key!r} is for a module Ember does not have{_unloadable(found)}")
        index, weight = int(found.group(1)), _EMBER_PATH[found.group(2)]
        if not _peft_adapts(peft_config, module_name):  # PEFT would not load these factors: another model
            fields = ("target_modules", "layers_to_transform", "layers_pattern", "exclude_modules")
            settings = ", ".join(f"{field}={peft_config.get(field)!r}" for field in fields if peft_config.get(field))
            raise DataError(
                f"{path}: adapter tensor {key!r} is for a module that adapter_config.json ({settings}) does not "
                "adapt, so PEFT would ignore it; the tensors must be for the modules and layers the config names"
            )
        stem = key[: -len(".lora_A.weight")]
        a, b = take(key), take(stem + ".lora_B.weight")
        rank = a.shape[0]
        default_alpha = peft_config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
        alpha = _pattern_value(peft_config.get("alpha_pattern") or {}, module_name, default_alpha)
        scale = alpha / math.sqrt(rank) if peft_config.get("use_rslora") else alpha / rank
        in_shape, out_shape = _weight_shapes(config, weight)
        expected = ((rank, math.prod(in_shape)), (math.prod(out_shape), rank))
        if (a.shape, b.shape) != expected:
            raise DataError(
                f"{path}: {module_name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this model's "
                f"{module_name} takes [r, {expected[0][1]}] and [{expected[1][0]}, r] (an adapter of another base "
                "model?)"
            )
        default_rank = peft_config.get("r", PEFT_DEFAULT_RANK)
        declared = _pattern_value(peft_config.get("rank_pattern") or {}, module_name, default_rank)
        if declared != rank:  # PEFT refuses it (size mismatch); the scale alpha / r would be a guess
            raise DataError(
                f"{path}: {module_name} has rank-{rank} factors but adapter_config.json gives it r={declared} "
                "(r / rank_pattern), which PEFT refuses to load"
            )
        leaves = {
            "lora_a": a.T.reshape(*in_shape, rank).astype(dtype),
            "lora_b": b.T.reshape(rank, *out_shape).astype(dtype),
            "lora_scale": np.asarray(scale, np.float32),
        }
        magnitude = stem + ".lora_magnitude_vector"
        if bool(peft_config.get("use_dora")) != (magnitude in tensors):  # PEFT follows the flag, not the file
            raise DataError(
                f"{path}: adapter_config.json has use_dora={bool(peft_config.get('use_dora'))} but {module_name} "
                f"{'has' if magnitude in tensors else 'has no'} lora_magnitude_vector; a DoRA adapter has both, a "
                "LoRA adapter neither"
            )
        if magnitude in tensors:
            leaves["lora_magnitude"] = take(magnitude).reshape(out_shape).astype(np.float32)
        layers[index].update({part_name(weight, part): value for part, value in leaves.items()})
    check_all_used(config, tensors, used, what=f"PEFT adapter {path}")
    if not any(layers):
        raise DataError(f"{path} has no LoRA tensors")
    if config.scan_layers:
        layers = _same_shapes(layers, config)
    return layers_from_list(config, [tree_from_paths(layer) for layer in layers])


def with_adapter(params: Mapping[str, Any], adapter: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with the adapter leaves of ``adapter`` added (both nested dicts)."""
    return tree_from_paths({**param_paths(params), **param_paths(adapter)})


def _weight_shapes(config: ModelConfig, weight: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in_shape, out_shape)`` of the Ember weight at per-layer path ``weight``."""
    heads, kv_heads, head_dim, d = config.num_heads, config.kv_heads, config.head_size, config.d_model
    shared = config.moe.shared_experts * (config.moe.shared_expert_dim or config.expert_dim)
    width = shared if weight.startswith("moe/") else config.mlp_dim
    return {
        "attn/q/kernel": ((d,), (heads, head_dim)),
        "attn/k/kernel": ((d,), (kv_heads, head_dim)),
        "attn/v/kernel": ((d,), (kv_heads, head_dim)),
        "attn/o/kernel": ((heads, head_dim), (d,)),
    }.get(weight, ((width,), (d,)) if weight.endswith("down") else ((d,), (width,)))


def _same_shapes(layers: list[dict[str, Any]], config: ModelConfig) -> list[dict[str, Any]]:
    """Per-layer flat adapter dicts padded so every layer of a block position has the same
    leaves and shapes (zero adapters; ranks padded with zeros), as stacking needs."""
    period = config.layer_period
    for block in range(period):
        group = layers[block::period]
        weights = sorted({p.rsplit("_lora_", 1)[0] for layer in group for p in layer})
        for weight in weights:
            rank = max(
                layer[part_name(weight, "lora_a")].shape[-1] for layer in group if part_name(weight, "lora_a") in layer
            )
            in_shape, out_shape = _weight_shapes(config, weight)
            dora = any(part_name(weight, "lora_magnitude") in layer for layer in group)
            for layer in group:
                a = layer.get(part_name(weight, "lora_a"), np.zeros((*in_shape, 0), np.float32))
                b = layer.get(part_name(weight, "lora_b"), np.zeros((0, *out_shape), np.float32))
                pad = rank - a.shape[-1]
                layer[part_name(weight, "lora_a")] = np.concatenate([a, np.zeros((*in_shape, pad), a.dtype)], -1)
                layer[part_name(weight, "lora_b")] = np.concatenate([b, np.zeros((pad, *out_shape), b.dtype)], 0)
                layer.setdefault(part_name(weight, "lora_scale"), np.asarray(1.0, np.float32))
                if dora and part_name(weight, "lora_magnitude") not in layer:
                    raise DataError(
                        f"DoRA adapters on {weight} in some layers only cannot be stacked; load with scan_layers=False"
                    )
    return layers


def _peft_adapts(peft_config: Mapping[str, Any], module_name: str) -> bool:
    """Whether PEFT puts an adapter on ``module_name`` (``model.layers.<i>.<module>``) under
    ``peft_config`` (``peft.tuners.tuners_utils.check_target_module_exists``): ``target_modules``
    a regex (full match) or names (the module's or its tail's), then ``layers_to_transform``
    (an index or a list; the layer's index is the number after ``layers_pattern``, or after the
    first dotted part without one) and ``exclude_modules``. Without ``target_modules`` or with
    ``"all-linear"`` every module Ember reads is taken as adapted."""
    excluded = peft_config.get("exclude_modules")
    if isinstance(excluded, str) and re.fullmatch(excluded, module_name):
        return False
    if isinstance(excluded, list) and any(module_name == e or module_name.endswith(f".{e}") for e in excluded):
        return False
    targets = peft_config.get("target_modules")
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module_name) is not None
    if module_name in targets:
        return True
    if not any(module_name.endswith(f".{target}") for target in targets):
        return False
    layers = peft_config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = peft_config.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    heads = [rf"(?:^|.*?\.){pattern}\." for pattern in patterns] or [r".*?\.[^.]*\."]
    found = next(filter(None, (re.match(rf"{head}(?P<idx>\d+)\.", module_name) for head in heads)), None)
    if found is None:
        return False
    return int(found["idx"]) in ([layers] if isinstance(layers, int) else layers)


def _pattern_value(patterns: Mapping[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's per-module override: the first pattern matching the end of ``module_name``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def _module_of(weight: str, kind: str) -> str:
    """The PEFT module of the adapted ``weight`` (a per-layer path) in a layer of mixer ``kind``."""
    if weight not in MODULES:
        raise DataError(f"an adapter on {weight} has no PEFT equivalent; PEFT-exportable weights: {', '.join(MODULES)}")
    if weight.startswith("attn/") and kind not in ATTENTION_KINDS:
        raise DataError(
            f"an adapter on {weight} of a {kind} layer has no PEFT equivalent (PEFT's self_attn projections are "
            f"those of {', '.join(ATTENTION_KINDS)} layers); adapt the attention layers' or the MLPs' weights only"
        )
    return MODULES[weight]


__all__ = [
    "ATTENTION_KINDS",
    "MODULES",
    "check_peft_exportable",
    "load_peft_adapter",
    "save_peft_adapter",
    "with_adapter",
]
