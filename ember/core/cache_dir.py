"""Where Ember keeps what it prepares once and reuses (the built-in corpora's token files).

    ember_cache_dir()              # $EMBER_CACHE, else ~/.cache/ember
    ember_cache_dir("scratch")     # an explicit directory wins over both

Every reader of the cache resolves it here, so the environment variable and its default are
spelled once.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EMBER_CACHE"
"""The environment variable that moves Ember's cache directory."""


def ember_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$EMBER_CACHE`` if set, else ``~/.cache/ember`` (an empty
    string counts as not given); a leading ``~`` is expanded in each."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ember").expanduser()


__all__ = ["CACHE_ENV", "ember_cache_dir"]
