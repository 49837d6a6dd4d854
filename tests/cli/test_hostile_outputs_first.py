"""Hostile input (issue 33, case 18): an output path that cannot be written (--out,
--plot, --trace, --timeline) is refused before the work starts, as bad input naming the
flag, not after a search or a sweep has run."""

from __future__ import annotations

import json

import pytest
from hostile import CLUSTER, PLAN, assert_one_line, cli

WORKLOAD = ["--cluster", "cluster.json", "--model", "tiny-gpt", "--global-batch", "4"]
# command line, output flag, the function doing the work (never reached)
CASES = {
    "search --out": (["search", *WORKLOAD], "--out", "hyperpipe.search.search.search"),
    "whatif --plot": (["whatif", *WORKLOAD, "--vary", "inter_node.bandwidth=10 Gbit/s,100 Gbit/s"],
                      "--plot", "hyperpipe.whatif.sweep.whatif"),
    "simulate --timeline": (["simulate", "--plan", "plan.json"], "--timeline",
                            "hyperpipe.sim.simulator.simulate"),
    "calibrate --out": (["calibrate", "--measure", "--model", "tiny-gpt"], "--out",
                        "hyperpipe.exec.profiler.measure_profile"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("where", ["a file as folder", "a folder as file"])
def test_unwritable_output_is_refused_before_work(name, where, tmp_path, capsys,
                                                  monkeypatch):
    argv, flag, work = CASES[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "cluster.json").write_text(json.dumps(CLUSTER))
    (tmp_path / "blocker").write_text("a file")
    (tmp_path / "folder.png").mkdir()
    out = "blocker/out.png" if where == "a file as folder" else "folder.png"

    def never(*args, **kwargs):
        raise AssertionError(f"{work} ran before {flag} was checked")
    module, _, attr = work.rpartition(".")
    monkeypatch.setattr(module + "." + attr, never, raising=True)
    rc, _, err = cli(capsys, [*argv, flag, out])
    assert_one_line(rc, err, 2, flag)
