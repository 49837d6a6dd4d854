"""Hostile outputs (issue 16): the one safe writer never replaces or writes through a
special file, never follows a planted temporary name, and leaves nothing behind."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import stat
import subprocess
import sys
import textwrap

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    mkfifo,
    temp_files,
)

from hyperpipe.core.errors import BadInput, WriteFailed
from hyperpipe.core.files import atomic_output, write_atomic

SCHEDULE = ["schedule", "--kind", "1f1b", "--devices", "2", "--microbatches", "2"]


def _special_targets(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "link.txt"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    return {"dev-null": "/dev/null", "fifo": str(mkfifo(tmp_path / "f.fifo")),
            "symlink": str(link), "dangling-symlink": str(dangling),
            "directory": str(tmp_path)}


@pytest.mark.parametrize("kind", ["dev-null", "fifo", "symlink", "dangling-symlink",
                                  "directory"])
@pytest.mark.parametrize("fmt", ["text", "png"])
def test_special_out_is_refused_and_never_replaced(kind, fmt, tmp_path, capsys):
    target = _special_targets(tmp_path)[kind]
    before = os.lstat(target)
    rc, _, err = cli(capsys, [*SCHEDULE, "--format", fmt, "--out", target])
    assert_one_line(rc, err, 2, "never replaces")
    after = os.lstat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev)
    assert (tmp_path / "victim.txt").read_text() == "keep me\n"
    assert not (tmp_path / "nowhere.txt").exists()
    assert temp_files(tmp_path) == []


def test_trace_and_plan_outputs_refuse_special_files_too(tmp_path, capsys):
    fifo = str(mkfifo(tmp_path / "t.fifo"))
    for argv in (["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--pp", "2",
                  "--micro-batch", "1", "--global-batch", "2", "--trace", fifo],
                 ["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--pp", "2",
                  "--micro-batch", "1", "--global-batch", "2", "--chrome", "/dev/null"],
                 ["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                  "--global-batch", "4", "--pp", "2", "--dp", "1", "--out", fifo]):
        rc, _, err = cli(capsys, argv)
        assert_one_line(rc, err, 2, "never replaces")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_whatif_plot_goes_through_the_safe_writer(tmp_path, capsys):
    fifo = mkfifo(tmp_path / "plot.png")
    rc, _, err = cli(capsys, ["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                              "--global-batch", "4", "--vary", "global_batch=4",
                              "--plot", str(fifo)])
    assert_one_line(rc, err, 2, "plot.png", "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert temp_files(tmp_path) == []


def test_planted_symlink_at_the_old_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "s.txt"
    (tmp_path / f".s.txt.tmp{os.getpid()}").symlink_to(victim)   # the old, predictable name
    names = set()
    for text in ("one\n", "two\n"):
        with atomic_output(out) as f:
            names.update(temp_files(tmp_path))
            f.write(text.encode())
    assert out.read_text() == "two\n" and victim.read_text() == "keep me\n"
    assert len(names) == 2                      # a fresh, unpredictable name each time
    assert not out.is_symlink()


def test_written_file_has_ordinary_mode_and_replaces_a_regular_file(tmp_path):
    out = tmp_path / "deep" / "er" / "r.json"
    write_atomic(out, "old")
    write_atomic(out, "new")
    mask = os.umask(0)
    os.umask(mask)
    assert out.read_text() == "new"
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError, SystemExit])
def test_an_interrupted_write_leaves_no_temp_file_and_the_old_content(exc, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")
    with pytest.raises(exc):
        with atomic_output(out) as f:
            f.write(b"x" * 100_000)
            raise exc()
    assert out.read_text() == "old"
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO])
def test_a_failing_disk_is_a_host_failure_with_nothing_left(code, tmp_path):
    """A full disk, a quota, `ulimit -f` or an I/O error is the host's failure, not bad
    input (it had been BadInput, exit 2): WriteFailed, exit 1; the old file is kept."""
    out = tmp_path / "r.json"
    out.write_text("old")
    with pytest.raises(WriteFailed, match="^" + re.escape(f"{out}: could not be written "
                                                          f"({os.strerror(code)}")):
        with atomic_output(out) as f:
            f.write(b"new")
            raise OSError(code, os.strerror(code))
    assert out.read_text() == "old" and temp_files(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOENT, errno.EACCES, errno.EISDIR, errno.EROFS])
def test_a_path_the_user_must_change_stays_bad_input(code, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(BadInput, match=r"r\.json: expected a writable file path"):
        with atomic_output(out):
            raise OSError(code, os.strerror(code))
    assert not out.exists() and temp_files(tmp_path) == []


def test_out_over_ulimit_f_exits_1_with_one_line_and_nothing_written(tmp_path):
    """`(ulimit -f 0; hyperpipe schedule ... --out f.txt)` had ended in exit 2, "expected
    a writable file path (File too large)": the path is fine, the host's limit is not."""
    out = tmp_path / "f.txt"
    out.write_text("old")
    proc = subprocess.run(
        [sys.executable, "-m", "hyperpipe", *SCHEDULE, "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                              (0, resource.RLIM_INFINITY)))
    line = assert_one_line(proc.returncode, proc.stderr, 1, "f.txt", "could not be written",
                           os.strerror(errno.EFBIG))
    assert "expected" not in line
    assert out.read_text() == "old" and temp_files(tmp_path) == []


def test_sigterm_during_a_write_removes_the_temp_file(tmp_path):
    out = tmp_path / "big.bin"
    script = textwrap.dedent(f"""
        import os, signal, time
        from hyperpipe.cli.main import sigterm_as_exit
        from hyperpipe.core.files import atomic_output
        with sigterm_as_exit():
            with atomic_output({str(out)!r}) as f:
                f.write(b"x" * 4_000_000)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(20)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 143, proc.stderr
    assert not out.exists() and temp_files(tmp_path) == []


@pytest.mark.parametrize("case", ["5000-chars", "newline-in-name", "proc-file", "under-a-file"])
def test_unwritable_paths_are_one_line(case, tmp_path, capsys):
    (tmp_path / "plain").write_text("x")
    out = {"5000-chars": str(tmp_path / ("a" * 5000)),
           "newline-in-name": str(tmp_path / "plain" / "x\ny.txt"),
           "proc-file": "/proc/self/pagemap",
           "under-a-file": str(tmp_path / "plain" / "x.txt")}[case]
    rc, _, err = cli(capsys, [*SCHEDULE, "--out", out])
    line = assert_one_line(rc, err, 2)
    assert len(line) < 600
    assert temp_files(tmp_path) == []


def test_checkpoint_rank_file_that_is_a_symlink_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from hyperpipe.exec.checkpoint import rank_file, save_rank
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    path = rank_file(tmp_path / "ck", 3, 0)
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    with pytest.raises(BadInput, match="symbolic link"):
        save_rank(tmp_path / "ck", 3, 0, {"w": torch.zeros(2)})
    assert victim.read_text() == "keep me\n" and temp_files(tmp_path) == []
    save_rank(tmp_path / "ck", 4, 0, {"w": torch.ones(2)})
    assert torch.load(rank_file(tmp_path / "ck", 4, 0), weights_only=True)["w"].sum() == 2


@pytest.mark.parametrize("out", ["fifo", "/dev/null", "file", "proc"])
def test_demo_out_is_checked_before_any_work(out, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = {"fifo": str(mkfifo(tmp_path / "f")), "/dev/null": "/dev/null",
            "file": str(tmp_path / "file"), "proc": "/proc/hyperpipe-demo"}[out]
    rc, _, err = cli(capsys, ["demo", "--out", path])
    assert_one_line(rc, err, 2, "--out")


def test_calibrate_out_special_file(tmp_path, capsys):
    trace = {"format": "hyperpipe.trace/1", "events": []}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    rc, _, err = cli(capsys, ["calibrate", "--trace", tmp_path / "t.json", "--out",
                              "/dev/null"])
    assert_one_line(rc, err, 2, "/dev/null", "never replaces")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
