"""Exceptions that callers are expected to handle."""


class SolverError(RuntimeError):
    """A numerical solve failed on valid input: callers such as the Amortizer fall back.

    Configuration and shape errors are ``ValueError`` and are never swallowed.
    """
