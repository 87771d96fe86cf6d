"""Expensive fixture artefacts (a subprocess run's output directory) built once per test session.

A module-scoped fixture is rebuilt by every xdist worker that runs one of the module's tests,
and ``--dist load`` deals a module's tests out to both workers. For a fixture whose product is
files on disk, the first worker to ask builds it under the session's shared temporary directory
while holding a lock, and the others wait for it and read the same files. Without xdist it is
an ordinary build in the session's temporary directory.
"""

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """Runs ``build(directory)`` into a fresh ``directory`` once per test session and returns
    the directory; every later call (from any worker) returns it without building. A build that
    raises leaves nothing behind, so the next caller builds again and fails the same way."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the controller's temporary directory, shared by its workers
    directory, done = root / f"once-{name}", root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory
