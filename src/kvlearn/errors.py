"""Errors that kvlearn raises for bad input: one line, naming the bad value and the valid range."""


class KVLearnError(ValueError):
    """A user-facing error: bad configuration, bad tensor shapes, unknown names or missing files.

    The message is one line that names the offending value and what would be valid. The CLI prints it
    without a traceback.
    """


def check(condition: bool, message: str) -> None:
    """Raise :class:`KVLearnError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise KVLearnError(message)
