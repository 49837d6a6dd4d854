"""The two error tiers of HyperPipe.

`BadInput` is for anything a user can get wrong (a file, a field, a flag); the command
line turns it into one line on stderr and exit status 2. `InfeasiblePlan` is for a plan
that is legal but does not fit (out of memory, too few devices); the search catches and
counts it. Anything else is a bug and exits 1.
"""

from __future__ import annotations


class HyperPipeError(Exception):
    """Base class of the errors HyperPipe raises on purpose."""


class BadInput(HyperPipeError):
    """Bad user input. `where` names the file and field, `expected` says what was wanted.

    str(err) is the one line the command line prints, e.g.
    ``cluster.yaml: nodes[1].count: expected a positive integer, got -2``.
    """

    def __init__(self, where: str, expected: str, got: object = None, *, has_got: bool = True):
        self.where = where
        self.expected = expected
        self.got = got
        msg = f"{where}: expected {expected}"
        if has_got and got is not None:
            msg += f", got {_short(got)}"
        super().__init__(msg)


class InfeasiblePlan(HyperPipeError):
    """A legal plan that cannot run: out of memory, not enough devices, and so on."""


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
