"""The checkpoint lock (issue 33, case 1): `DIR/.lock` is opened without following a
link and never through a special file or a second name of another file; a planted one
is refused with one line and exit 2 before any rank starts, and its target is never
written."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hostile import (
    PLAN,
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
    mkfifo,
)

import hyperpipe.exec.launch as launch
from hyperpipe.core.errors import BadInput
from hyperpipe.exec import checkpoint

KINDS = ["symlink", "dangling-symlink", "hardlink", "fifo", "directory"]


@pytest.fixture
def no_ranks(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "launch_local", started)


def _plant(kind: str, ck, tmp_path):
    """A planted DIR/.lock of `kind`; returns the victim file it points at (or None)."""
    ck.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    lock = ck / checkpoint.LOCK
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "nowhere.txt")
    elif kind == "hardlink":
        os.link(victim, lock)
    elif kind == "fifo":
        mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    return victim


@pytest.mark.parametrize("kind", KINDS)
def test_planted_lock_is_refused_before_any_rank(kind, tmp_path, capsys, no_ranks):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    ck = tmp_path / "ck"
    victim = _plant(kind, ck, tmp_path)
    before = os.lstat(ck / checkpoint.LOCK)
    rc, _, err = cli(capsys, ["run", "--plan", plan, "--no-emulate", "--steps", "1",
                              "--checkpoint", ck])
    assert_one_line(rc, err, 2, ".lock")
    assert victim.read_text() == "keep me\n"
    assert not (tmp_path / "nowhere.txt").exists()
    after = os.lstat(ck / checkpoint.LOCK)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert not (ck / checkpoint.RUN_RECORD).exists()


@pytest.mark.parametrize("kind", KINDS)
def test_claim_directory_never_writes_through_a_planted_lock(kind, tmp_path):
    ck = tmp_path / "ck"
    victim = _plant(kind, ck, tmp_path)
    with pytest.raises(BadInput, match="lock"):
        checkpoint.claim_directory(ck, "f" * 64, 0, 2, resume=False, overwrite=False)
    assert victim.read_text() == "keep me\n"


def test_a_regular_lock_is_created_reused_and_exclusive(tmp_path):
    ck = tmp_path / "ck"
    lock = checkpoint.claim_directory(ck, "f" * 64, 0, 2, resume=False, overwrite=False)
    try:
        assert (ck / checkpoint.LOCK).read_text() == f"{os.getpid()}\n"
        with pytest.raises(BadInput, match=f"process {os.getpid()} holds"):
            checkpoint.claim_directory(ck, "f" * 64, 0, 2, resume=False, overwrite=False)
    finally:
        lock.close()
    again = checkpoint.claim_directory(ck, "f" * 64, 0, 2, resume=False, overwrite=False)
    again.close()
    assert stat.S_ISREG(os.lstat(ck / checkpoint.LOCK).st_mode)
