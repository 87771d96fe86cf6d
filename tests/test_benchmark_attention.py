"""benchmarks/attention.py: the TPU baseline (JAX's splash attention) computes our function,
checked in the Pallas interpreter since no TPU is here."""

import math

import jax
import numpy as np
import pytest

from benchmarks.attention import BASELINES, _splash
from ember.kernels_pallas.flash_attention import flash_attention_reference
from tests.tolerances import assert_allclose


@pytest.mark.parametrize("causal", [False, True])
def test_splash_baseline_equals_the_reference(causal):
    q, k, v = (jax.random.normal(key, (2, 256, 2, 128)) for key in jax.random.split(jax.random.key(0), 3))
    assert BASELINES["splash"].prescaled_q  # splash applies no 1/sqrt(head_dim)
    got = _splash(q / math.sqrt(128), k, v, causal, interpret=True)
    assert_allclose(np.asarray(got), np.asarray(flash_attention_reference(q, k, v, causal=causal)), dtype="float32")
