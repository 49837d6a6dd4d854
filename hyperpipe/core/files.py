"""Reading user files safely, writing outputs atomically, and checking fields with clear errors.

Reading: every loader reads through `load_document`: a regular file only, at most
`limits.MAX_JSON_BYTES` / `limits.MAX_YAML_BYTES`; YAML through the safe loader after a
pass that refuses documents deeper than `limits.MAX_DOCUMENT_DEPTH`, recursive aliases
and more than `limits.MAX_DOCUMENT_NODES` values with aliases expanded (an alias bomb is
refused before any object is built); JSON without NaN/Infinity; every value checked
(64-bit integers, finite floats). A `Fields` view then rejects unknown keys and names the
file and field path in each error, with at most a short escaped value, never a line.

Writing: every output goes through `atomic_output` / `write_atomic`: a temporary file in
the target's folder (O_EXCL | O_NOFOLLOW, unpredictable name), fsynced, renamed over the
target, and removed on any exit before that. A target that exists and is not a regular
file (symlink, FIFO, device such as /dev/null, directory) is refused with BadInput, never
replaced nor written through: one rule is easier to trust than a list of exceptions.
A path the user must change (a missing folder, no permission) is BadInput; a write the
host fails (a full disk, `ulimit -f`, an I/O error) is WriteFailed, exit status 1.
A lock file (`open_lock_file`) follows the same rule. `check_outputs` refuses, before
any work, an output that names one of the command's inputs or another of its outputs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from hyperpipe.core import limits, stopping
from hyperpipe.core.errors import BadInput, WriteFailed, key_name, one_line
from hyperpipe.core.units import EXPONENT_FORM, parse_quantity

MAX_INPUT_BYTES = limits.MAX_JSON_BYTES     # kept for callers of the old name
# How user files are decoded: UTF-8, a leading byte-order mark dropped (editors on
# Windows write one; json.loads refuses it, YAML skips it), so JSON and YAML read alike.
TEXT_ENCODING = "utf-8-sig"


# --------------------------------------------------------------------------- reading
def show_path(path: str | os.PathLike) -> str:
    """A path as an error shows it: escaped, and shortened in the middle if long."""
    return one_line(os.fspath(path), 160)


def _read_capped(path: Path, cap: int) -> bytes:
    """The bytes of regular file `path`, refusing more than `cap` of them. Opened
    non-blocking and checked with fstat, so a FIFO or device is refused, not read."""
    where = show_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInput(where, f"an existing, readable file ({exc.strerror or exc})",
                       has_got=False) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(where, f"a regular file (it is {_kind(st.st_mode)})",
                           has_got=False)
        if st.st_size > cap:
            raise BadInput(where, f"a file of at most {cap} bytes", f"{st.st_size} bytes")
        chunks, total = [], 0
        while True:         # /proc files say size 0: read, but never more than the cap
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise BadInput(where, f"a file of at most {cap} bytes", "more",)
        return b"".join(chunks)
    except OSError as exc:
        raise BadInput(where, f"a readable file ({exc.strerror or exc})",
                       has_got=False) from None
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def load_document(path: str | os.PathLike) -> Any:
    """Parse a YAML or JSON file (by extension; YAML otherwise) into plain data, within
    the limits of `hyperpipe.core.limits` (see the module docstring)."""
    p = Path(path)
    where = show_path(p)
    is_json = p.suffix.lower() == ".json"
    raw = _read_capped(p, limits.MAX_JSON_BYTES if is_json else limits.MAX_YAML_BYTES)
    text = raw.decode(TEXT_ENCODING, errors="replace")
    if is_json:
        data = _parse_json(text, where)
    else:
        _check_yaml_events(text, where)
        try:
            loader = _UniqueKeyLoader(text)
            loader.where = where
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
        except yaml.YAMLError as exc:
            raise BadInput(where, f"valid YAML ({_yaml_problem(exc)})", has_got=False
                           ) from None
    check_values(data, where)
    return data


def read_text(path: str | os.PathLike, cap: int = limits.MAX_YAML_BYTES) -> str:
    """The text of regular file `path` (UTF-8, a leading BOM dropped, undecodable bytes
    replaced), refusing a file over `cap` bytes, a directory, a FIFO or a device
    (BadInput naming the file)."""
    return _read_capped(Path(path), cap).decode(TEXT_ENCODING, errors="replace")


def _parse_json(text: str, where: str) -> Any:
    def constant(name: str) -> Any:
        raise BadInput(where, "finite numbers (JSON has no NaN or Infinity)", name)

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > 19:
            raise BadInput(where, f"integers of at most 19 digits (within +-{limits.MAX_INT})",
                           f"an integer of {len(digits.lstrip('-'))} digits")
        return int(digits)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise BadInput(where, f"each key once in an object (key {key_name(key)} "
                               "is repeated)", has_got=False)
            out[key] = value
        return out

    try:
        return json.loads(text, parse_constant=constant, parse_int=integer,
                          object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise BadInput(where, f"valid JSON ({exc.msg} at line {exc.lineno})",
                       has_got=False) from None
    except RecursionError:
        raise BadInput(where, f"JSON nested at most {limits.MAX_DOCUMENT_DEPTH} levels deep",
                       has_got=False) from None


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(_SAFE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a mapping that repeats a key (YAML says keys are unique;
    PyYAML would keep the last silently). Keys brought in by a merge (``<<``) may be
    overridden, as YAML allows."""

    where = "YAML"

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:                  # an unhashable key: refused later
                    continue
                if repeated:
                    raise BadInput(self.where, f"each key once in a mapping (key "
                                   f"{key_name(key)} is repeated at line "
                                   f"{key_node.start_mark.line + 1})", has_got=False)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What a YAML error says, without the snippet of the file that str(exc) quotes."""
    mark = getattr(exc, "problem_mark", None)
    line = f" at line {mark.line + 1}" if mark is not None else ""
    return one_line(str(getattr(exc, "problem", None) or "parse error"), 80) + line


def _check_yaml_events(text: str, where: str) -> None:
    """Walk the YAML event stream (no objects built yet) and refuse a document nested
    deeper than MAX_DOCUMENT_DEPTH, with more than MAX_DOCUMENT_NODES values once its
    aliases are expanded, or with an alias to a collection that contains it."""
    total = 0                                  # values so far, aliases expanded
    open_: list[tuple[str | None, int]] = []   # (anchor, total at its start) per level
    sizes: dict[str, int] = {}                 # anchor -> expanded size, once closed
    try:
        for event in yaml.parse(text, Loader=_SAFE_LOADER):
            if isinstance(event, yaml.AliasEvent):
                if event.anchor not in sizes:
                    if any(a == event.anchor for a, _ in open_):
                        raise BadInput(where, "no recursive YAML aliases (an alias inside "
                                       "the collection it names)", event.anchor)
                    continue                   # undefined: the loader says so below
                total += sizes[event.anchor]
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                total += 1
                open_.append((event.anchor, total - 1))
                if len(open_) > limits.MAX_DOCUMENT_DEPTH:
                    raise BadInput(where, f"YAML nested at most {limits.MAX_DOCUMENT_DEPTH} "
                                   "levels deep", has_got=False)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, start = open_.pop()
                if anchor is not None:
                    sizes[anchor] = total - start
            elif isinstance(event, yaml.ScalarEvent):
                total += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            if total > limits.MAX_DOCUMENT_NODES:
                raise BadInput(where, f"at most {limits.MAX_DOCUMENT_NODES} values with YAML "
                               "aliases expanded", has_got=False)
    except yaml.YAMLError as exc:
        raise BadInput(where, f"valid YAML ({_yaml_problem(exc)})", has_got=False) from None


def check_values(data: Any, where: str) -> None:
    """Refuse non-finite floats, integers beyond 64 bits, too many values or too deep
    nesting anywhere in a parsed document; the error names the field path."""
    count = 0
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        count += 1
        if count > limits.MAX_DOCUMENT_NODES:
            raise BadInput(where, f"at most {limits.MAX_DOCUMENT_NODES} values",
                           has_got=False)
        if depth > limits.MAX_DOCUMENT_DEPTH:
            raise BadInput(where, f"nesting at most {limits.MAX_DOCUMENT_DEPTH} levels deep",
                           has_got=False)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, int):
            if abs(value) > limits.MAX_INT:
                raise BadInput(f"{where}: {path or '(top)'}",
                               f"an integer within +-{limits.MAX_INT}", value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise BadInput(f"{where}: {path or '(top)'}", "a finite number", value)
        elif isinstance(value, dict):
            for k, v in value.items():
                key = key_name(k)
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise BadInput(f"{where}: {path or '(top)'}", "keys that are strings "
                                   "or numbers", type(k).__name__)
                stack.append((k, f"{path}.{key}" if path else key, depth + 1))
                stack.append((v, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((v, f"{path}[{i}]", depth + 1))
        else:
            raise BadInput(f"{where}: {path or '(top)'}", "a string, number, true/false, list "
                           "or mapping (YAML dates, binary and sets have no meaning here)",
                           type(value).__name__)


# --------------------------------------------------------------------------- writing
# Why a path cannot be written that the user can change (bad input, exit 2): a folder
# that is missing or not a folder (a file where a folder of the path would be made), a
# folder given as the file, no permission, a read-only file system, a name too long, a
# name the file system refuses or a loop of links. Anything else (a full disk, a quota,
# `ulimit -f`, an I/O error) is the host's failure: WriteFailed, exit 1.
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
                          errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG,
                          errno.EINVAL, errno.EILSEQ, errno.ELOOP, errno.ETXTBSY})


def _cannot_write(where: str, exc: OSError, expected: str = "a writable file path"
                  ) -> BadInput | WriteFailed:
    """The error for an OSError met writing `where`: BadInput (`expected`, the reason in
    brackets) when the path is the problem (`_PATH_ERRNOS`), else WriteFailed."""
    why = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in _PATH_ERRNOS:
        return BadInput(where, f"{expected} ({why})", has_got=False)
    return WriteFailed(f"{where}: could not be written ({why}: a limit or failure of this "
                       "host, not of the path); nothing was written")


def _check_target(p: Path) -> None:
    """Refuse a target that exists and is not a regular file (or is a symlink)."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _cannot_write(show_path(p), exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(show_path(p), f"a writable file path: a regular file or a new name (it is "
                       f"{_kind(st.st_mode)}; HyperPipe never replaces or writes through "
                       "special files)", has_got=False)


def check_writable(path: str | os.PathLike) -> None:
    """Raise BadInput now unless `path` could be written by `atomic_output`: its folder
    exists or can be made, is writable, and the target is new or a regular file. For
    checking output paths before long work starts (a run's --trace)."""
    p = Path(path)
    if len(os.fspath(p)) > limits.MAX_PATH_CHARS:
        raise BadInput(show_path(p), f"a path of at most {limits.MAX_PATH_CHARS} characters",
                       has_got=False)
    _check_target(p)
    probe_folder(p.parent)


def probe_folder(folder: Path) -> None:
    """Raise BadInput unless a file can be created in `folder`, or, if it does not exist
    yet, in its nearest existing ancestor (where it would be made). Creates and removes
    one temporary file: a true test even for root and read-only file systems. A host
    failure (a full disk, a quota) is WriteFailed, not BadInput (`_cannot_write`)."""
    folder = Path(folder)
    where = show_path(folder)
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise BadInput(where, f"a folder that can be written ({show_path(folder)} is not a "
                       "folder)", has_got=False)
    try:
        fd, tmp = _create_temp(folder / "probe")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise _cannot_write(where, exc, "a folder that can be written") from None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Yield a binary file whose content replaces `path` when the block ends normally,
    and leaves no trace otherwise (an existing target keeps its content). See the module
    docstring for the rules. A path that cannot be written for the user's reasons (a
    missing folder, a folder as the path, no permission) is bad input (BadInput, exit 2);
    a write the host fails (a full disk, `ulimit -f`, an I/O error) is WriteFailed
    (exit 1)."""
    p = Path(path)
    where = show_path(p)
    tmp: Path | None = None
    try:
        if len(os.fspath(p)) > limits.MAX_PATH_CHARS:
            raise BadInput(where, f"a path of at most {limits.MAX_PATH_CHARS} characters",
                           has_got=False)
        _check_target(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(p)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _check_target(p)                      # a special file planted meanwhile
        os.rename(tmp, p)       # replaces a symlink planted now, never follows it
        tmp = None
        _fsync_dir(p.parent)
    except OSError as exc:
        raise _cannot_write(where, exc) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@stopping.shield     # a stop waits until the caller holds the name, to remove it
def _create_temp(p: Path) -> tuple[int, Path]:
    """A new file beside `p` under an unpredictable name, created exclusively (never
    through a planted file or symlink), mode 0666 less the umask like any new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    short = os.fsdecode(os.fsencode(p.name)[:180])     # bytes: NAME_MAX counts bytes
    for _ in range(100):
        tmp = p.with_name(f".{short}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {p}")


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; some file systems cannot open a folder for this."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_lock_file(path: str | os.PathLike) -> IO[str]:
    """Open (or create) lock file `path` for reading and writing without following a
    link: an existing one must be a regular file with no other name (a symlink, FIFO,
    device, directory or hard link planted there is refused with BadInput, never opened
    for writing), a new one is created exclusively. The caller flocks and writes it."""
    p = Path(path)
    where = show_path(p)
    base = os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    fd = -1
    try:
        for _ in range(100):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                try:
                    fd = os.open(p, base | os.O_CREAT | os.O_EXCL, 0o666)
                    break
                except FileExistsError:
                    continue                # planted meanwhile: look at it again
            if not stat.S_ISREG(st.st_mode):
                raise BadInput(where, f"a regular lock file or none (it is {_kind(st.st_mode)}; "
                               "HyperPipe never writes through special files)", has_got=False)
            try:
                fd = os.open(p, base)       # no O_CREAT: a name swapped meanwhile fails
                break
            except FileNotFoundError:
                continue
        else:
            raise BadInput(where, "a lock file that stays put", has_got=False)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            kind = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else \
                f"a file with {st.st_nlink} hard links"
            raise BadInput(where, f"a regular lock file or none (it is {kind}; HyperPipe "
                           "never writes through special files)", has_got=False)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "r+", encoding="utf-8", errors="replace")
        fd = -1
        return f
    except OSError as exc:
        raise _cannot_write(where, exc, "a regular lock file or none") from None
    finally:
        if fd >= 0:
            os.close(fd)


PathArg = tuple[str, "str | os.PathLike | None"]


def _resolved(path: str | os.PathLike) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.abspath(path)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    if _resolved(a) == _resolved(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_outputs(inputs: Iterable[PathArg], outputs: Iterable[PathArg],
                  folders: Iterable[PathArg] = ()) -> None:
    """Raise BadInput (before any work) when an output path names one of the command's
    inputs or another of its outputs, or lies inside a folder the command owns (a run's
    --checkpoint DIR). Each argument is (flag, path or None); paths are compared resolved
    (links followed, os.path.samefile for the rest), so ``x`` and ``./d/../x`` are one
    file. An input that is not an existing file (a preset name) cannot be overwritten.
    Then each output must be writable (`check_writable`), so that a long command never
    fails at its last step for want of a folder."""
    ins = [(flag, p) for flag, p in inputs if p and path_exists(Path(p), regular=True)]
    outs = [(flag, p) for flag, p in outputs if p]
    dirs = [(flag, p) for flag, p in folders if p]
    for i, (flag, out) in enumerate(outs):
        where = f"{flag} {show_path(out)}"
        for other, path in ins + outs[:i]:
            if _same_file(out, path):
                kind = "output" if (other, path) in outs else "input"
                raise BadInput(where, f"a file apart from the {kind} {other} (it names the "
                               "same file, which the output would overwrite)", has_got=False)
        for other, folder in dirs:
            top, inside = _resolved(folder), _resolved(out)
            if inside == top or inside.startswith(top.rstrip(os.sep) + os.sep):
                raise BadInput(where, f"a path outside {other} {show_path(folder)} (the "
                               "command owns that folder's files)", has_got=False)
    for flag, out in outs:
        try:
            check_writable(out)
        except BadInput as exc:
            raise BadInput(f"{flag} {exc.where}", exc.expected, has_got=False) from None


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` (str as UTF-8, or bytes) to `path` through `atomic_output`."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    with atomic_output(path) as f:
        f.write(data)


FIGURE_FORMATS = ("png", "svg", "pdf")


def figure_format(path: str | os.PathLike) -> str:
    """The image format a figure path asks for by its suffix (png, svg or pdf); anything
    else is bad input, so that a file's name never lies about its bytes."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FIGURE_FORMATS:
        raise BadInput(show_path(Path(path)), "a figure file ending in .png, .svg or .pdf",
                       Path(path).suffix or "no suffix")
    return suffix


def plain_text_figures() -> None:
    """Figures made from now on draw every text as written: a `$...$` in a user's name
    or --vary value is not parsed as matplotlib mathtext (which fails on most of them,
    after all the work). Call before the figure's texts are made."""
    import matplotlib
    matplotlib.rcParams["text.parse_math"] = False


def save_figure(fig: Any, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """Save a matplotlib figure through `atomic_output`, in the format its suffix names
    (PNG, SVG or PDF; figure_format). Every text is drawn as written: a `$...$` in a
    name or a --vary value is not matplotlib mathtext (which fails on most of them)."""
    plain_text_figures()
    from matplotlib.text import Text
    from matplotlib.ticker import FuncFormatter, NullFormatter
    for text in fig.findobj(Text):
        text.set_parse_math(False)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":    # its default ticks are mathtext: 1, 10, 100
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(NullFormatter())
    with atomic_output(path) as f:     # its refusals (special files...) come first
        fig.savefig(f, dpi=dpi, format=figure_format(path))


class Fields:
    """A checked view of one mapping in a user file.

    >>> f = Fields({"count": 2}, "c.yaml: nodes[0]")
    >>> f.positive_int("count")
    2
    """

    def __init__(self, data: Any, where: str, allowed: Iterable[str] | None = None):
        if not isinstance(data, dict):
            raise BadInput(where, "a mapping", type(data).__name__)
        self.data = data
        self.where = where
        if allowed is not None:
            unknown = sorted(set(map(str, data)) - set(allowed))
            if unknown:
                raise BadInput(f"{where}.{key_name(unknown[0])}",
                               f"one of the known keys {sorted(allowed)}", "an unknown key",
                               has_got=False)

    def at(self, key: str) -> str:
        return f"{self.where}.{key}"

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise BadInput(self.at(key), "a value (the field is required)", has_got=False)
            return default
        return self.data[key]

    def sub(self, key: str, allowed: Iterable[str] | None = None) -> Fields:
        return Fields(self.raw(key), self.at(key), allowed)

    def string(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not value:
            raise BadInput(self.at(key), "a non-empty string", value)
        return value

    def positive_int(self, key: str, default: Any = ..., *, allow_zero: bool = False,
                     at_most: int = limits.MAX_INT) -> int:
        """`check_int` of the field, a whole number in exponent form read as that integer:
        JSON's ``1e6`` (a float) and YAML's ``1e6`` (a string under YAML 1.1, which wants
        ``1.0e+6`` for a float)."""
        value = whole_number(self.raw(key, default))
        return check_int(value, self.at(key), allow_zero=allow_zero, at_most=at_most)

    def number(self, key: str, default: Any = ..., *, positive: bool = False,
               at_most: float | None = None, at_least: float = 0.0) -> float:
        """A finite number >= 0 (> 0 if `positive`); with `at_least` > 0, no positive
        value below it (a subnormal efficiency would divide times into infinity). A string
        in exponent form is that number (`exponent_number`: YAML 1.1 reads ``5e-1`` as a
        string), as the whole-number fields read it (`positive_int`)."""
        raw = self.raw(key, default)
        value = exponent_number(raw)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0 or (positive and value == 0) \
                or (at_most is not None and value > at_most) or (0 < value < at_least):
            want = "a positive number" if positive else "a non-negative number"
            if at_least:
                want += f" of at least {at_least:g}"
            if at_most is not None:
                want += f" of at most {at_most}"
            raise BadInput(self.at(key), want, raw)
        return float(value)

    def quantity(self, key: str, dimension: str, default: Any = ..., *,
                 positive: bool = True) -> float:
        value = self.raw(key, default)
        return parse_quantity(value, dimension, where=self.at(key), allow_zero=not positive)

    def choice(self, key: str, options: Iterable[str], default: Any = ...) -> str:
        value = self.raw(key, default)
        options = list(options)
        if value not in options:
            raise BadInput(self.at(key), f"one of {options}", value)
        return value

    def items(self, key: str, default: Any = ...) -> list:
        value = self.raw(key, default)
        if not isinstance(value, list):
            raise BadInput(self.at(key), "a list", type(value).__name__)
        return value


def check_int(value: Any, where: str, *, allow_zero: bool = False,
              at_most: int = limits.MAX_INT) -> int:
    """Return `value` if it is a positive (or non-negative) integer of at most `at_most`
    (a documented limit of `hyperpipe.core.limits`), else raise BadInput."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
            or (value == 0 and not allow_zero) or value > at_most:
        want = "a non-negative integer" if allow_zero else "a positive integer"
        if isinstance(value, int) and value > at_most:
            want += f" of at most {at_most} (hyperpipe.core.limits)"
        raise BadInput(where, want, value)
    return value


def exponent_number(value: Any) -> Any:
    """`value` as a float when it is a string of a number in exponent form (``5e-1``,
    ``1e6``, ``2.5E3``, ASCII digits: `units.NUMBER`), which YAML 1.1 reads as a string
    where YAML 1.2 and JSON read a number; else `value` unchanged. The one rule by which
    every number field (`Fields.number`, `whole_number`, a quantity's
    `units.parse_quantity`) reads a number written so."""
    if isinstance(value, str) and EXPONENT_FORM.fullmatch(value.strip()):
        return float(value)
    return value


def whole_number(value: Any) -> Any:
    """`value` as an int when it is a finite whole float, or a string in exponent form
    (``1e6``, ``2.5E3``: `exponent_number`) of a whole number; else `value` unchanged."""
    value = exponent_number(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def path_exists(p: Path, *, regular: bool = False) -> bool:
    """Whether `p` exists (and is a regular file, with `regular`); False for a path the
    OS refuses to look up (too long, a loop of links, no permission)."""
    try:
        st = os.stat(p)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) or not regular


def resolve_ref(ref: str, base_dir: Path | None) -> Path | None:
    """A file path inside a document is relative to that document's folder."""
    p = Path(ref)
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p
