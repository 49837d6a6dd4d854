"""Issue 33, case 3: `calibrate --measure` predicts its memory and refuses a profile
that cannot fit this host before it allocates anything."""

from __future__ import annotations

import pytest

from hyperpipe.cli import main, run_console
from hyperpipe.core.errors import BadInput
from hyperpipe.exec import profiler


def _no_work(*args, **kwargs):
    raise AssertionError("the profile started")


def test_profile_over_the_host_is_refused_before_work(monkeypatch):
    monkeypatch.setattr(profiler, "profile_layers", _no_work)
    with pytest.raises(BadInput, match=r"^--micro-batches: expected sizes whose profile of "
                       r"tiny-gpt fits this host: predicted .* GB at micro-batch 65536, and "
                       r"this host has 16.0 GB available, got 65536$"):
        profiler.measure_profile("tiny-gpt", micro_batches=(1, 65536), host_bytes=16e9)


def test_calibrate_measure_65536_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiler, "profile_layers", _no_work)
    monkeypatch.setattr(run_console, "host_available_bytes", lambda: 16e9)
    out = tmp_path / "p.json"
    rc = main(["calibrate", "--measure", "--model", "tiny-gpt", "--micro-batches", "65536",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "16.0 GB available" in err
    assert not out.exists()


def test_the_default_sizes_fit():
    from hyperpipe.models import load_model
    assert profiler.profile_memory_bytes(load_model("tiny-gpt"), (1, 2, 4)) < 1e9
