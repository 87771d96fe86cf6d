"""ember.kernels_pallas.dispatch: impl resolution on this (CPU) backend."""

import pytest

from ember.kernels_pallas.dispatch import resolve_impl


def test_auto_on_cpu_is_xla_and_explicit_choices_pass_through():
    assert resolve_impl("auto", op="flash_attention") == "xla"
    assert resolve_impl("auto", op="x", kernel_backends=("cpu",)) == "pallas"
    assert resolve_impl("interpret", op="x") == "interpret"
    assert resolve_impl("xla", op="x") == "xla"


def test_bad_impl_and_pallas_without_kernel_raise():
    with pytest.raises(
        ValueError, match=r"flash_attention: impl must be one of 'auto', 'pallas', 'interpret', 'xla', got 'cuda'"
    ):
        resolve_impl("cuda", op="flash_attention")
    with pytest.raises(ValueError, match=r"ssd: impl='pallas' needs a backend .* use impl='interpret'"):
        resolve_impl("pallas", op="ssd")
