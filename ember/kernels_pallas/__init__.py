"""Pallas kernels, one file per op: the public op, its plain-jnp ``*_reference`` and a
dispatcher over ``impl`` in {"auto", "pallas", "interpret", "interpret_tpu", "xla"} (DESIGN.md
section 4; :mod:`ember.kernels_pallas.dispatch`). Ops with a TPU kernel (``*_tpu.py``) run it
on a TPU and, with ``impl="interpret_tpu"``, in JAX's TPU interpret mode anywhere;
:mod:`ember.kernels_pallas.kernel_table` lists which op has which.

The package gives the ops themselves::

    from ember.kernels_pallas import flash_attention, FlashBlockSizes, CausalMask
    out = flash_attention(q, k, v, block_mask=CausalMask(), impl="interpret")

Each op's name is both a function here and the file defining it
(``ember/kernels_pallas/flash_attention.py``). The package attribute is the function; the
file's other names are imported from the file, ``from ember.kernels_pallas.flash_attention
import attention_problem`` (``importlib.import_module`` also returns the module). Do not
write ``import ember.kernels_pallas.flash_attention as m``: Python resolves ``m`` through
the package attribute, so ``m`` is the function.
"""

# Each op's file is imported (and bound as a package attribute) before its function
# replaces that attribute; nothing later re-imports an op file, so the function stays.
from ember.kernels_pallas.block_mask import (
    BlockMask,
    CausalMask,
    ChunkedCausalMask,
    ExplicitBlockMask,
    LocalGlobalMask,
    LocalMask,
)
from ember.kernels_pallas.flash_attention import FlashBlockSizes, flash_attention, flash_attention_reference
from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul, grouped_matmul_reference
from ember.kernels_pallas.linear_attention import (
    ChunkSize,
    linear_attention,
    linear_attention_reference,
    linear_attention_step,
)
from ember.kernels_pallas.quantized_formats import QuantizedMatrix
from ember.kernels_pallas.quantized_matmul import (
    QuantizedMatmulBlockSizes,
    quantized_matmul,
    quantized_matmul_reference,
)
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from ember.kernels_pallas.short_conv import short_conv, short_conv_reference, short_conv_step
from ember.kernels_pallas.ssd import ssd, ssd_reference, ssd_step

__all__ = [
    "BlockMask",
    "CausalMask",
    "ChunkSize",
    "ChunkedCausalMask",
    "ExplicitBlockMask",
    "FlashBlockSizes",
    "GroupedMatmulBlockSizes",
    "LocalGlobalMask",
    "LocalMask",
    "QuantizedMatmulBlockSizes",
    "QuantizedMatrix",
    "flash_attention",
    "flash_attention_reference",
    "grouped_matmul",
    "grouped_matmul_reference",
    "linear_attention",
    "linear_attention_reference",
    "linear_attention_step",
    "quantized_matmul",
    "quantized_matmul_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "short_conv",
    "short_conv_reference",
    "short_conv_step",
    "ssd",
    "ssd_reference",
    "ssd_step",
]
