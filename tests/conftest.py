"""Test set-up shared by the whole suite.

JAX is given 8 host CPU devices *before it is imported anywhere*, so sharding is tested on
every machine. Hypothesis gets a profile without deadlines (JIT compilation makes first
examples slow), a bounded example count for CI, and the same examples on every machine
(derandomized, no example database): unset, Hypothesis picks them at random and replays its
``.hypothesis`` database, except where ``CI`` is set, so CI ran other examples than a local run.

Every process of a test session -- the xdist workers and each subprocess a test spawns (``ember``
CLI runs, notebook kernels, multi-process trainers) -- shares one JAX persistent compilation cache
in a temporary directory made for the session, so a program is compiled by XLA once per session
rather than once per process or per test that rebuilds it. The cache is keyed by the program, its
devices and compile options, so a hit runs the same executable a compilation would have built.
XLA compiles fast for the same reason (compiling dominates at test sizes; tests/xla_settings.py):
backend optimizations off and XLA:CPU's loop emitters, except in tests marked ``xla_optimized``.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

# Environment variables (not jax.config) so that workers and subprocesses inherit them; the first
# process of the session (xdist's controller, or plain pytest) makes the directory and removes it.
_OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-test-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from tests import xla_settings  # noqa: E402

xla_settings.compile_fast_by_default()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    "ember", deadline=None, max_examples=20, print_blob=True, derandomize=True, database=None
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ember"))


LONG_MODULES = (
    "tests/test_examples.py",
    "tests/training/test_linearize.py",
    "tests/test_benchmark_gpu.py",
    "tests/training/test_quantize.py",
    "tests/training/test_lm_moe.py",
    "tests/training/test_finetune.py",
    "tests/training/test_lm_ssm.py",
    "tests/training/test_grpo.py",
    "tests/training/test_lm_trainer.py",
    "tests/models/test_mixlora.py",
    "tests/training/rl/test_multi_agent_ppo.py",
    "tests/training/rl/test_pqn.py",
    "tests/training/rl/test_sac.py",
    "tests/training/rl/test_ppo.py",
    "tests/training/rl/test_dqn.py",
    "tests/serving/test_weight_dtypes.py",
    "tests/models/test_hf_mamba2.py",
    "tests/training/test_lm_resume.py",
    "tests/training/test_lm_sampling.py",
)
"""Modules holding the suite's longest tests (the CI log's slowest durations). They run first, so
that the tests left when a worker runs out are short ones: it steals them from the other worker's
queue (``make test`` runs xdist with ``--dist worksteal``), and both finish together instead of
one of them spending the last minutes alone on a long test."""


def pytest_collection_modifyitems(config, items):
    rank = {module: index for index, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_MODULES)))  # stable: order kept within


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _xla_optimizations_for_marked_tests(request):
    """XLA's optimizations back on for a test marked ``xla_optimized`` (in this process and in the
    subprocesses it starts), whose compiled programs run long enough to pay for them."""
    if request.node.get_closest_marker("xla_optimized") is None:
        yield
        return
    with xla_settings.xla_optimizations():
        yield


@pytest.fixture
def rng(request) -> jax.Array:
    """A PRNG key that differs per test (seeded from the test's name), so inputs are fresh
    random draws yet every failure reproduces."""
    import zlib

    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
