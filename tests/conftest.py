"""Test set-up shared by the whole suite.

JAX is given 8 host CPU devices *before it is imported anywhere*, so sharding is tested on
every machine. Hypothesis gets a profile without deadlines (JIT compilation makes first
examples slow) and a bounded example count for CI.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile("ember", deadline=None, max_examples=20, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ember"))


@pytest.fixture
def rng(request) -> jax.Array:
    """A PRNG key that differs per test (seeded from the test's name), so inputs are fresh
    random draws yet every failure reproduces."""
    import zlib

    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
