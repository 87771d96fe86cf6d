"""ember.kernels_pallas.dispatch: which implementation each ``impl`` resolves to, on CPU,
GPU and TPU backends (the backend is faked; nothing is compiled)."""

import jax
import pytest

from ember.kernels_pallas.dispatch import kernel_platform, pallas_interpret, resolve_impl

GPU_AND_TPU = ("gpu", "tpu")


@pytest.mark.parametrize(
    "backend, kernel_backends, auto, platform",
    [
        ("cpu", GPU_AND_TPU, "xla", None),
        ("gpu", GPU_AND_TPU, "pallas", "gpu"),
        ("tpu", GPU_AND_TPU, "pallas", "tpu"),
        ("tpu", ("gpu",), "xla", None),  # an op with a GPU kernel only runs XLA on a TPU
        ("gpu", (), "xla", None),
    ],
)
def test_auto_picks_the_backends_kernel_else_xla(monkeypatch, backend, kernel_backends, auto, platform):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    resolved = resolve_impl("auto", op="op", kernel_backends=kernel_backends)
    assert resolved == auto
    assert kernel_platform(resolved) == platform
    assert pallas_interpret(resolved) is False


def test_explicit_choices_pass_through_and_name_their_kernel():
    assert resolve_impl("xla", op="x") == "xla"
    assert resolve_impl("interpret", op="x") == "interpret"
    assert kernel_platform("interpret") == "gpu" and pallas_interpret("interpret") is True
    assert resolve_impl("interpret_tpu", op="x") == "interpret_tpu"
    assert kernel_platform("interpret_tpu") == "tpu"
    from jax.experimental.pallas import tpu as pltpu

    assert isinstance(pallas_interpret("interpret_tpu"), pltpu.InterpretParams)


def test_bad_impl_and_missing_kernels_raise():
    with pytest.raises(
        ValueError,
        match=r"flash_attention: impl must be one of 'auto', 'pallas', 'interpret', 'interpret_tpu', 'xla', got 'cuda'",
    ):
        resolve_impl("cuda", op="flash_attention")
    with pytest.raises(ValueError, match=r"ssd: impl='pallas' needs a backend .* use impl='interpret'"):
        resolve_impl("pallas", op="ssd")
    with pytest.raises(ValueError, match=r"short_conv: impl='interpret_tpu' runs the op's TPU kernel, but short_conv"):
        resolve_impl("interpret_tpu", op="short_conv", kernel_backends=())


# What ``impl="auto"`` runs for each op, per backend (the kernel table ``ember info`` prints).
AUTO_BY_BACKEND = {
    "flash_attention": {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"},
    "ragged_paged_attention": {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"},
    "linear_attention": {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"},
    "ssd": {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"},
    "grouped_matmul": {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"},
    "quantized_matmul": {"cpu": "xla", "gpu": "pallas", "tpu": "xla"},
    "short_conv": {"cpu": "xla", "gpu": "xla", "tpu": "xla"},
}


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_auto_per_op_and_backend(monkeypatch, backend):
    from ember.kernels_pallas.kernel_table import OPS, kernel_table

    assert set(OPS) == set(AUTO_BY_BACKEND)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    table = kernel_table()
    assert {op: row["auto_here"] for op, row in table.items()} == {
        op: picks[backend] for op, picks in AUTO_BY_BACKEND.items()
    }
