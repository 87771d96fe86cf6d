"""How the test suite asks XLA to compile. At test sizes compiling dominates, so by default the suite
compiles fast (:func:`compile_fast_by_default`, which tests/conftest.py calls before JAX is imported):

- XLA's backend optimizations off (``JAX_DISABLE_MOST_OPTIMIZATIONS``): about 40% less CPU for the
  model and kernel tests;
- XLA:CPU's loop emitters instead of its MLIR fusion emitters (:data:`LOOP_EMITTERS`): they compile
  about twice as fast (the adapter and linear-attention tests, one CPU: 82 s -> 41 s);
- code generated in one piece (:data:`ONE_CODEGEN_PART`), not split for a thread pool: each test
  worker has one core (those tests again: 44-50 s -> 40 s). With optimizations on, the compiled
  arithmetic is bit for bit the same either way (PPO's CartPole training, checked).

Long training runs pay for the optimized compile, and their asserted outcomes were measured with
it: for a test marked ``xla_optimized``, conftest enters :func:`xla_optimizations`, which brings
optimizations and the fusion emitters back, in this process and in the subprocesses it starts
(:func:`fast_compiles` goes back to fast compiles inside such a test, for its short programs).
The emitters matter there: PPO's shipped CartPole config solved CartPole on 8 of 8 seeds compiled
with the fusion emitters and on 5 of 8 with the loop emitters (their arithmetic differs).

JAX is imported inside the functions: this module is imported before JAX reads its environment.
"""

import contextlib
import os
from collections.abc import Iterator

import pytest

LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
"""The XLA flag for the loop emitters, in ``XLA_FLAGS`` of every process the suite starts while it
compiles fast (XLA reads the variable once per process, when it starts its backend)."""

ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
"""The XLA flag for code generation in one piece, in ``XLA_FLAGS`` of every process the suite starts."""


def compile_fast_by_default() -> None:
    """Fast compiles for this process and every subprocess it starts (environment variables, read
    when JAX is imported and when its backend starts), unless the environment already chose; with
    the loop emitters, also :func:`_install_emitter_switch` in this process."""
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""), loop_emitters=True)
    if _loop_emitters_in_environment():
        _install_emitter_switch()


def _loop_emitters_in_environment() -> bool:
    return LOOP_EMITTERS in os.environ.get("XLA_FLAGS", "").split()


def suite_xla_flags(flags: str, *, loop_emitters: bool) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with :data:`ONE_CODEGEN_PART` and, if ``loop_emitters``,
    :data:`LOOP_EMITTERS` added, each unless ``flags`` already set it."""
    for flag in (ONE_CODEGEN_PART, LOOP_EMITTERS) if loop_emitters else (ONE_CODEGEN_PART,):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}"
    return flags.strip()


def without_loop_emitters(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) without :data:`LOOP_EMITTERS`."""
    return " ".join(flag for flag in flags.split() if flag != LOOP_EMITTERS)


def subprocess_xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a subprocess that sets its own ``flags``: with the suite's flags, the loop
    emitters only while this process compiles fast (outside :func:`xla_optimizations`)."""
    return suite_xla_flags(" ".join(flags), loop_emitters=_loop_emitters_in_environment())


def _install_emitter_switch() -> None:
    """Makes this process pick the emitters per compilation: the loop emitters while XLA's
    optimizations are off, the fusion emitters while they are on. ``XLA_FLAGS`` is read once per
    process, but one test worker runs marked and unmarked tests; JAX has no public per-process
    setting for compile options, so this wraps its own ``get_compile_options`` (once)."""
    import jax
    from jax._src import compiler

    original = compiler.get_compile_options
    if getattr(original, "follows_optimizations", False):
        return

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        fusion = not jax.config.read("jax_disable_most_optimizations")
        overrides = {"xla_cpu_use_fusion_emitters": fusion, **(env_options_overrides or {})}
        return original(*args, env_options_overrides=overrides, **kwargs)

    get_compile_options.follows_optimizations = True
    compiler.get_compile_options = get_compile_options


@contextlib.contextmanager
def xla_optimizations() -> Iterator[None]:
    """Optimizations and the fusion emitters back on, in this process and in the subprocesses it
    starts, for the ``with`` body."""
    with pytest.MonkeyPatch.context() as patch, _most_optimizations_disabled(False):
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
        patch.setenv("XLA_FLAGS", without_loop_emitters(os.environ.get("XLA_FLAGS", "")))
        yield


@contextlib.contextmanager
def fast_compiles() -> Iterator[None]:
    """The suite's fast compiles again (optimizations off, so the loop emitters too) in this process
    for the ``with`` body: for the short programs of a test marked ``xla_optimized``, such as a trained
    policy's evaluation, which optimized took seconds to compile and runs in a fraction of one either way
    (MPE IPPO's and PPO Pendulum's tests: 57.1 -> 50.1 CPU s together). The training keeps the optimized
    compile its outcome was measured with; the evaluated returns of every RL test's seed came out the
    same to 1e-5 (PQN CartPole: one of 50 episodes 2 steps longer, mean 481.32 -> 481.36)."""
    with _most_optimizations_disabled(True):
        yield


@contextlib.contextmanager
def _most_optimizations_disabled(disabled: bool) -> Iterator[None]:
    """JAX's ``jax_disable_most_optimizations`` set to ``disabled`` in this process for the ``with``
    body (the emitter switch follows it), then restored."""
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", disabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
