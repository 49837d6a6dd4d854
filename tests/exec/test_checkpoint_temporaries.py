"""Issue 33 case 17: the launcher removes what ranks killed mid-write left in the step
directories (after SIGKILL a rank cannot remove its own temporary file)."""

from __future__ import annotations

from hyperpipe.exec import checkpoint


def test_remove_temporaries_removes_only_the_ranks_temporaries(tmp_path):
    step = checkpoint.step_dir(tmp_path, 4)
    step.mkdir(parents=True)
    kept = [step / "rank-00000.pt", step / "manifest.json", tmp_path / "run.json",
            step / "notes.tmp"]
    for p in kept:
        p.write_text("x")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    gone = [step / ".rank-00001.pt.0123456789abcdef.tmp",
            step / ".manifest.json.0123456789abcdef.tmp"]
    for p in gone:
        p.write_text("half")
    link = step / ".rank-00002.pt.fedcba9876543210.tmp"
    link.symlink_to(victim)                  # a link is left alone, never followed
    checkpoint.remove_temporaries(tmp_path)
    assert all(p.exists() for p in kept)
    assert not any(p.exists() for p in gone)
    assert victim.read_text() == "keep me" and link.is_symlink()
