"""A named pipe holding a text, for tests of inputs that must read a pipe as a file
(``--prompts /dev/stdin``, a shell's ``<(...)``): ``Path.is_file`` says a FIFO is not one."""

import contextlib
import os
import threading
from pathlib import Path


@contextlib.contextmanager
def pipe_holding(path: Path, text: str):
    """Yields ``path``, a FIFO that a writer thread fills with ``text`` once a reader opens it;
    the writer is joined on leaving (a daemon: a reader that never comes leaves it blocked)."""
    os.mkfifo(path)
    writer = threading.Thread(daemon=True, target=lambda: path.write_text(text))
    writer.start()
    yield path
    writer.join()
