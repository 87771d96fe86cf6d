"""Spaces: sampling, membership and clipping at the edges gymnasium's Box defines."""

import jax.numpy as jnp
import numpy as np

from ember.envs import spaces


def test_integer_box_with_an_infinite_bound_clips_to_the_dtype_limits():
    box = spaces.Box(0, np.inf, (3,), jnp.int32)
    np.testing.assert_array_equal(box.clip(jnp.array([-4, 2, 7])), [0, 2, 7])
    box = spaces.Box(-np.inf, 5, (2,), jnp.int32)
    np.testing.assert_array_equal(box.clip(jnp.array([-9, 8])), [-9, 5])
