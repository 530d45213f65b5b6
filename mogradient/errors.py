"""Exceptions that callers are expected to handle."""


class SolverError(RuntimeError):
    """A numerical solve failed on valid input: callers such as the Amortizer fall back.

    Configuration and shape errors are ``ValueError`` and are never swallowed.
    """


class UnusedParameterError(ValueError):
    """A parameter is not in the graph of any objective: a configuration error, not a zero.

    Zeros are right only where one objective does not touch a parameter that another
    does; a parameter no objective reaches means the wrong tensors were passed.
    """
