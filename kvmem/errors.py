"""The one exception type kvmem raises for user errors."""

__all__ = ["KvmemError"]


class KvmemError(Exception):
    """Something the user asked for cannot be done; the message says what and how to fix it.

    Messages are one line: what was expected, what was received, and the fix.
    The command-line interface prints them without a traceback (unless ``--debug``).
    """
