"""Expensive module fixtures under xdist: built once per session, or compiled once per session.

A module-scoped fixture is rebuilt by every xdist worker that runs one of the module's tests,
and ``--dist load`` deals a module's tests out to both workers, often at the same moment. For a
fixture whose product is files on disk, ``build_once`` lets the first worker build it under the
session's shared temporary directory while holding a lock; the others wait and read the same
files. For one whose product lives in the process (compiled programs), ``one_at_a_time`` makes
the workers build it in turn, so the later ones load the programs from the session's persistent
compilation cache (tests/conftest.py) instead of compiling them concurrently. Without xdist both
are ordinary builds.
"""

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def _session_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the controller's temporary directory, shared by its workers
    return root


@contextlib.contextmanager
def one_at_a_time(tmp_path_factory, name: str) -> Iterator[None]:
    """Holds the session-wide lock ``name`` (one xdist worker at a time) for the ``with`` body."""
    with open(_session_root(tmp_path_factory) / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
        yield


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """Runs ``build(directory)`` into a fresh ``directory`` once per test session and returns
    the directory; every later call (from any worker) returns it without building. A build that
    raises leaves nothing behind, so the next caller builds again and fails the same way."""
    root = _session_root(tmp_path_factory)
    directory, done = root / f"once-{name}", root / f"once-{name}.done"
    with one_at_a_time(tmp_path_factory, name):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory
