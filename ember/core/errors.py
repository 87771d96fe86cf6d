"""Exception types shared across Ember.

Every error Ember raises for bad user input says what is wrong and what is allowed. These
classes subclass the built-in exception a caller would naturally catch (``ValueError``,
``LookupError``), so ``except ValueError`` keeps working.
"""


class EmberError(Exception):
    """Base class for Ember's own errors."""


class ConfigError(EmberError, ValueError):
    """A configuration is invalid: unknown key, wrong type, malformed override or bad value.

    Attributes:
      key: the dotted key path the error is about (``"train.steps"``), or ``None`` when the
        error concerns the whole config (for example a missing file).
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class UnknownNameError(EmberError, LookupError):
    """A name was looked up in a registry that does not hold it."""

    def __init__(self, message: str, name: str, suggestions: tuple[str, ...] = ()):
        super().__init__(message)
        self.name = name
        self.suggestions = suggestions

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return self.args[0]


class PathNotFoundError(EmberError, FileNotFoundError):
    """A file or directory given by the user does not exist, or does not hold what the
    command needs (a run directory without its config, a directory that is not an artifact)."""

    def __str__(self) -> str:  # OSError's would prefix an errno when given more arguments
        return self.args[0]


class DataError(EmberError, ValueError):
    """A file the user gave holds what Ember cannot use: a dataset with no text or torn files,
    a checkpoint missing tensors, an artifact of another format version."""
