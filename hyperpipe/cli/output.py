"""What the subcommands write: exit statuses, JSON on stdout, and text to a file or
stdout. Exit status: 0 success, 1 anything else, 2 bad input.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT = 0, 1, 2


class StdoutFailed(Exception):
    """Writing to stdout failed (closed, a full device, over `ulimit -f`): the command
    ends with one line and exit status 1. Not an OSError, so that no handler of a file's
    errors takes it for one of its own."""

    def __init__(self, exc: OSError | ValueError):
        code = getattr(exc, "errno", None)
        why = os.strerror(code) if code else str(exc) or type(exc).__name__
        super().__init__(f"cannot write to stdout: {why}")


class _GuardedStdout:
    """stdout whose write and flush failures raise StdoutFailed. A broken pipe (the
    reader left, as `| head` does) stays a BrokenPipeError: that is not a failure."""

    def __init__(self, stream: Any):
        self._stream = stream

    def _call(self, name: str, *args: Any) -> Any:
        if self._stream is None:                  # started with stdout closed
            raise StdoutFailed(OSError(errno.EBADF, os.strerror(errno.EBADF)))
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as exc:      # ValueError: a closed file object
            raise StdoutFailed(exc) from None

    def write(self, text: str) -> int:
        buffer = getattr(self._stream, "buffer", None)
        if buffer is None:
            return self._call("write", text)
        # Through the bytes layer: over `ulimit -f` it writes part and says so in its
        # count, which the text layer ignores (the rest would be lost without an error).
        data = memoryview(text.encode(self._stream.encoding or "utf-8",
                                      self._stream.errors or "strict"))
        self._call("flush")
        while data:
            try:
                done = buffer.write(data)
            except BrokenPipeError:
                raise
            except (OSError, ValueError) as exc:
                raise StdoutFailed(exc) from None
            data = data[done if done is not None else len(data):]
        if getattr(self._stream, "line_buffering", False) and "\n" in text or \
                getattr(self._stream, "write_through", False):
            self._call("flush")                   # a terminal sees each line at once
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._call("flush")

    def isatty(self) -> bool:
        try:
            return self._stream is not None and bool(self._stream.isatty())
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """While the block runs, a failed write to stdout raises StdoutFailed; after one,
    what is left in stdout's buffer goes to /dev/null, so that the interpreter's last
    flush adds no second message."""
    stream = sys.stdout
    sys.stdout = _GuardedStdout(stream)
    try:
        yield
    except StdoutFailed:
        _discard(stream)
        raise
    finally:
        sys.stdout = stream


def _discard(stream: Any) -> None:
    with contextlib.suppress(Exception):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def print_json(obj: Any) -> None:
    """`obj` as indented JSON on stdout (paths as strings)."""
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_text(text: str, out: str | None) -> None:
    """`text` written atomically to `out`, or to stdout without one."""
    if out:
        from hyperpipe.core.files import write_atomic
        write_atomic(out, text)
    else:
        sys.stdout.write(text)
