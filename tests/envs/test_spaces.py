"""Spaces: sampling, membership and clipping at the edges gymnasium's Box defines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.envs import spaces


def test_integer_box_with_an_infinite_bound_clips_to_the_dtype_limits():
    box = spaces.Box(0, np.inf, (3,), jnp.int32)
    np.testing.assert_array_equal(box.clip(jnp.array([-4, 2, 7])), [0, 2, 7])
    box = spaces.Box(-np.inf, 5, (2,), jnp.int32)
    np.testing.assert_array_equal(box.clip(jnp.array([-9, 8])), [-9, 5])


def test_integer_clip_moves_out_of_range_values_to_the_nearest_bound_without_wrapping():
    # The value was cast to the space's dtype before the clip, so it wrapped first: a uint8
    # Box(0, 10) gave [10, 4] for [-1, 260], an int8 Box(-5, 5) gave -5 for 200, a uint8
    # Discrete(4) gave 3 for -1, MultiDiscrete([3, 4], uint8) [2, 1] for [-1, 257], and
    # Discrete(4) gave 0 for the uint32 4294967295.
    box = spaces.Box(0, 10, (3,), jnp.uint8)
    np.testing.assert_array_equal(box.clip(jnp.array([-1, 260, 7])), np.array([0, 10, 7], np.uint8))
    assert box.clip(jnp.array([-1, 260, 7])).dtype == jnp.uint8
    np.testing.assert_array_equal(spaces.Box(-5, 5, (3,), jnp.int8).clip(jnp.array([200, 128, -129])), [5, 5, -5])
    np.testing.assert_array_equal(
        spaces.Box(300, 400, (2,), jnp.int16).clip(jnp.array([3, 255], jnp.uint8)), [300, 300]
    )
    assert int(spaces.Discrete(4, dtype=jnp.uint8).clip(jnp.array(-1))) == 0
    assert int(spaces.Discrete(4).clip(np.uint32(2**32 - 1))) == 3
    assert int(jax.jit(spaces.Discrete(4, start=-2).clip)(jnp.array(7))) == 1
    np.testing.assert_array_equal(spaces.MultiDiscrete([3, 4], dtype=jnp.uint8).clip(jnp.array([-1, 257])), [0, 3])


def test_box_sample_on_a_half_bounded_side_is_bound_plus_or_minus_an_exponential(rng):
    # gymnasium's Box.sample: low + Exp(1) / high - Exp(1) on one-sided bounds (not a
    # normal clipped to the bound, which puts half or all the mass on the bound itself).
    box = spaces.Box(np.array([0.0, -np.inf, -np.inf, -1.0]), np.array([np.inf, -5.0, np.inf, 1.0]), (4,))
    samples = np.asarray(jax.vmap(box.sample)(jax.random.split(rng, 4000)))
    assert samples.dtype == np.float32 and bool(jax.vmap(box.contains)(samples).all())
    above_low, below_high = samples[:, 0], -5.0 - samples[:, 1]
    for distance in (above_low, below_high):
        assert (distance > 0).mean() > 0.99  # no point mass at the bound
        assert abs(distance.mean() - 1.0) < 0.1  # Exp(1)
    assert (samples[:, 2] < 0).mean() > 0.4 and abs(samples[:, 2].std() - 1.0) < 0.1
    assert abs(samples[:, 3].mean()) < 0.1 and samples[:, 3].min() >= -1.0


def test_integer_box_contains_integers_only():
    box = spaces.Box(0, 5, (2,), jnp.int32)
    assert bool(box.contains(jnp.array([2, 1])))
    assert not bool(box.contains(jnp.array([2.5, 1.0])))  # gymnasium: False too
    assert bool(spaces.Box(0.0, 5.0, (2,)).contains(jnp.array([2, 1])))  # a real Box takes integers


def test_a_float32_box_contains_its_clipped_values_with_x64_enabled():
    # 4 pi rounds up in float32: with x64 on, the clipped 12.566371 was compared with the
    # float64 bound 12.5663706... and refused (so CheckActions rejected a clipped action).
    with jax.enable_x64(True):
        box = spaces.Box(-4 * np.pi, 4 * np.pi, (2,), jnp.float32)
        clipped = box.clip(jnp.array([100.0, -100.0]))
        assert clipped.dtype == jnp.float32 and bool(box.contains(clipped))


def test_discrete_sizes_must_be_integers():
    # Discrete(2.5) was Discrete(2) and MultiDiscrete([2.5, 3]) was MultiDiscrete([2, 3]), silently.
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match="Discrete: n must be an integer"):
            spaces.Discrete(bad)
    with pytest.raises(ValueError, match="integer entries"):
        spaces.MultiDiscrete([2.5, 3])
    assert spaces.Discrete(np.int64(3)).n == 3 and spaces.Discrete(jnp.int32(3), start=-1).start == -1
    assert spaces.MultiDiscrete(jnp.array([2, 3])).nvec.tolist() == [2, 3]


def test_box_bounds_must_not_be_nan():
    # Box(nan, 1.0) was accepted, and its clip turned every action into NaN.
    for low, high in ((np.nan, 1.0), (0.0, np.nan), ([0.0, np.nan], 1.0)):
        with pytest.raises(ValueError, match="no NaN"):
            spaces.Box(low, high)
