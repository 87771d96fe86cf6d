"""Low-rank adapters (LoRA, rsLoRA, DoRA, PiSSA, LoRA-GA, MixLoRA) as parameter-tree surgery.

    params = add_lora(params, LoraConfig(rank=8, targets=("q", "v")), rng)
    mask = adapter_mask(params)                  # the trainer trains the adapters only
    merged, record = merge(params)               # fold in; unmerge(merged, record) restores

The layer side (how a layer applies the adapter it finds next to a weight) is
``lowrank``; which leaves are adapters, ``leaves``; how a weight maps inputs to outputs,
``layout``; serving many at once, ``stacking``; PEFT's file format is ``ember.models.hf.peft``.
"""

from ember.models.adapters.leaves import adapted_paths, adapter_leaves, adapter_mask, without_adapters
from ember.models.adapters.lora import TARGETS, LoraConfig, add_lora, target_paths
from ember.models.adapters.merge import merge, merged_weights, unmerge
from ember.models.adapters.mixlora import MixLoraConfig, add_mixlora

__all__ = [
    "TARGETS",
    "LoraConfig",
    "MixLoraConfig",
    "adapted_paths",
    "adapter_leaves",
    "adapter_mask",
    "add_lora",
    "add_mixlora",
    "merge",
    "merged_weights",
    "target_paths",
    "unmerge",
    "without_adapters",
]
