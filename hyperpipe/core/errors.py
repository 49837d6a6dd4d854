"""The two error tiers of HyperPipe.

`BadInput` is for anything a user can get wrong (a file, a field, a flag); the command
line turns it into one line on stderr and exit status 2. `InfeasiblePlan` is for a plan
that is legal but does not fit (out of memory, too few devices); the search catches and
counts it. Anything else is a bug and exits 1.
"""

from __future__ import annotations

import re


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
        msg = f"{one_line(where, 240)}: expected {one_line(expected, 400)}"
        if has_got and got is not None:
            msg += f", got {short(got)}"
        super().__init__(msg)


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) arrived. A KeyboardInterrupt, so that every clean-up
    path that handles Ctrl-C handles it the same way; `signum` says which signal, and the
    command line exits with 128 + signum (143 for SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class WriteFailed(HyperPipeError):
    """A file could not be written for the host's reasons, not the user's (a full disk,
    a quota, a file-size limit such as `ulimit -f`, an I/O error): the command line prints
    the one line and exits with status 1. The writer leaves nothing half-written."""


class InfeasiblePlan(HyperPipeError):
    """A legal plan that cannot run: out of memory, not enough devices, and so on."""


def short(value: object, limit: int = 40) -> str:
    """A short, escaped form of a value from a user's file or flag: its repr, cut to
    `limit` characters, so that an error never echoes more than a fragment of a file.
    Huge integers are described by their digit count (their repr alone takes time)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits" if abs(value) < 10**4000 \
            else "an integer of over 4000 digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FIELD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+|@/-]{0,39}")


def key_name(key: object) -> str:
    """A key of a user's document as an error may show it: a name made of letters,
    digits and ``_ . + | @ / -`` (at most 40), as written; anything else (a line of a
    file that is not in the expected format, such as ``root:$6$...:19000:...``) only
    by its length, so that no error ever quotes a line of a private file."""
    text = str(key)
    if _FIELD_NAME.fullmatch(text):
        return text
    return f"(a key of {len(text)} characters, not shown)"


def printable(text: str) -> str:
    """`text` with control characters escaped (``\\x1b``, ``\\n``), as a name from a
    user's file is kept, so that no report, table or figure carries a terminal escape
    or a line break of a name."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def one_line(text: str, limit: int) -> str:
    """`text` with control characters escaped (a file name with a newline must not
    split the one-line error) and its middle cut out beyond `limit` characters."""
    text = printable(text)
    if len(text) > limit:
        keep = (limit - 5) // 2
        text = f"{text[:keep]}[...]{text[-keep:]}"
    return text
