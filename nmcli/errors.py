"""One exception family for everything a user can get wrong; the CLI maps it to one line."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (or its type), cut to `limit` characters."""
    text = str(exc).strip().splitlines()
    return text[0][:limit] if text else type(exc).__name__


class NmcliError(Exception):
    """A problem with the user's input or environment, reported as one line, exit code 2."""

    exit_code = 2


class InvalidPatternError(NmcliError):
    pass


class ModelError(NmcliError):
    """A file that is missing, not ONNX, unreadable, or holds nothing we can prune."""


class OutputError(NmcliError):
    """The output cannot be written where asked."""


class OpsLibraryError(NmcliError):
    """The compiled op library is missing or cannot be loaded."""
