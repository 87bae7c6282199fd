"""User-facing errors: the CLI prints their message (which names the file/row/key and the fix)
without a traceback. Programming errors stay ordinary exceptions and keep their tracebacks."""


class RLHFError(Exception):
    """Base of errors caused by input, configuration or on-disk state, not by a bug."""


class DataError(RLHFError):
    """Bad input data (names the file and row)."""


class CheckpointError(RLHFError):
    """A missing, corrupt or incompatible checkpoint (names the file)."""
