"""``from ember.kernels_pallas import <op>`` gives the op itself (DESIGN.md section 4), while
the op's file stays importable as a module for everything else it defines."""

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import ember.kernels_pallas as kernels_pallas
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

KERNELS_DIR = Path(kernels_pallas.__file__).parent

# op -> the block-size classes its callers configure it with
BLOCK_SIZE_CLASSES = {
    "flash_attention": ("FlashBlockSizes",),
    "grouped_matmul": ("GroupedMatmulBlockSizes",),
    "linear_attention": ("ChunkSize",),
    "quantized_matmul": ("QuantizedMatmulBlockSizes",),
    "ragged_paged_attention": (),
    "short_conv": (),
    "ssd": (),
}


def op_files() -> list[str]:
    """The op files: those defining both ``<file>`` and ``<file>_reference``."""
    ops = []
    for path in sorted(KERNELS_DIR.glob("*.py")):
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        if {path.stem, f"{path.stem}_reference"} <= defined:
            ops.append(path.stem)
    return ops


def test_every_op_file_is_listed():
    assert op_files() == sorted(BLOCK_SIZE_CLASSES)


@pytest.mark.parametrize("op", sorted(BLOCK_SIZE_CLASSES))
def test_package_gives_the_op_and_its_reference(op):
    module = importlib.import_module(f"ember.kernels_pallas.{op}")
    assert isinstance(module, types.ModuleType) and Path(module.__file__).name == f"{op}.py"
    assert getattr(kernels_pallas, op) is getattr(module, op)
    assert not isinstance(getattr(kernels_pallas, op), types.ModuleType)
    assert getattr(kernels_pallas, f"{op}_reference") is getattr(module, f"{op}_reference")
    for name in BLOCK_SIZE_CLASSES[op]:
        assert getattr(kernels_pallas, name) is getattr(module, name)
    for name in (op, f"{op}_reference", *BLOCK_SIZE_CLASSES[op]):
        assert name in kernels_pallas.__all__


def test_package_import_calls_the_op(rng):
    from ember.kernels_pallas import CausalMask, FlashBlockSizes, flash_attention, flash_attention_reference

    draw = numpy_rng(rng)
    q, k, v = (draw.standard_normal((2, 24, 2, 16), dtype=np.float32) for _ in range(3))
    out = flash_attention(q, k, v, block_mask=CausalMask(), block_sizes=FlashBlockSizes(8, 8), impl="interpret")
    assert_allclose(out, flash_attention_reference(q, k, v, causal=True))


def test_both_import_forms_in_a_fresh_interpreter():
    """The module forms the codebase uses, first thing in a new process (so no earlier import
    in this test session decides the order), then the package form."""
    lines = ["import importlib, types"]
    for op, classes in BLOCK_SIZE_CLASSES.items():
        lines += [
            f"import ember.kernels_pallas.{op}",
            f"from ember.kernels_pallas.{op} import {', '.join((op, f'{op}_reference', *classes))}",
            f"assert isinstance(importlib.import_module('ember.kernels_pallas.{op}'), types.ModuleType)",
        ]
    ops = ", ".join(BLOCK_SIZE_CLASSES)
    lines += [
        "import ember.kernels_pallas as package",
        f"from ember.kernels_pallas import {ops}",
        f"for op in ({ops},): assert callable(op) and not isinstance(op, types.ModuleType), op",
        f"for name in {list(BLOCK_SIZE_CLASSES)!r}: assert getattr(package, name) is "
        "getattr(importlib.import_module('ember.kernels_pallas.' + name), name)",
    ]
    result = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
