"""Hostile input, a fresh probe (issue 33, last Done-when item): the framework importers
and the stop-signal handler. A number where int() fails or that lists one unit per
layer, a table where a list belongs, a regular expression that does not compile, TOML
nested past the parser's recursion, a partition that takes hours: one line and exit 2.
A file that is not the expected format (a private file) is never quoted back, in an error
or in the import's notes, and names reach the terminal escaped. A stop raised where
Python drops it (a callback from C) is raised again, not lost."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from factories import A100_NODE
from hostile import (
    DS_JSON,
    MEGATRON,
    TOML,
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

from hyperpipe.frameworks import deepspeed as ds

# A line of a private file (the shape of /etc/shadow): no part of it may be printed (a
# name-shaped key such as `second` may be, as `errors.key_name` shows keys).
SECRET = "probe-user:$6$saltsalt$HASHHASHHASH:19000:0:99999:7:::\nsecond: line\n"
SECRET_WORDS = ("probe-user", "HASHHASH", "saltsalt")


def _write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _cluster(tmp_path: Path) -> str:
    return _write(tmp_path, "c.json", json.dumps(A100_NODE))


def _megatron(tmp_path: Path, text: str) -> list[str]:
    return ["import", "--from", "megatron", _write(tmp_path, "j.sh", text),
            "--cluster", _cluster(tmp_path)]


def _torchtitan(tmp_path: Path, text: str) -> list[str]:
    return ["import", "--from", "torchtitan", _write(tmp_path, "j.toml", text),
            "--cluster", _cluster(tmp_path)]


def _deepspeed(tmp_path: Path, doc_text: str, args: str = MEGATRON) -> list[str]:
    return ["import", "--from", "deepspeed", _write(tmp_path, "j.json", doc_text),
            "--args", _write(tmp_path, "a.sh", args), "--cluster", _cluster(tmp_path)]


def _layers(n: str) -> str:
    return MEGATRON.replace("--num-layers 4", f"--num-layers {n}")


REFUSED = {
    # int() takes these, and the layout then lists one unit per layer
    "megatron-num-layers-1e26": (_megatron, _layers("9" * 26), "--num-layers"),
    "megatron-num-layers-1e12": (_megatron, _layers("1000000000000"), "--num-layers"),
    # '²'.isdigit() is true, int('²') fails
    "megatron-launcher-superscript": (
        _megatron, "torchrun --nproc-per-node \u00b2 pretrain_gpt.py " + MEGATRON,
        "launcher processes per node"),
    "megatron-layout-5000-digits": (
        _megatron, MEGATRON + " --pipeline-model-parallel-layout 'Et*" + "9" * 5000 + "|L'",
        "--pipeline-model-parallel-layout"),
    "megatron-layout-group-5000-digits": (
        _megatron, MEGATRON + " --pipeline-model-parallel-layout 'E(tt)*" + "9" * 5000 + "|L'",
        "--pipeline-model-parallel-layout"),
    "torchtitan-model-not-a-table": (
        _torchtitan, "model = 5\n" + TOML.replace("[model]\n", "[other]\n"), "model"),
    "torchtitan-model-a-string": (
        _torchtitan, "model = 'llama3'\n" + TOML.replace("[model]\n", "[other]\n"), "model"),
    "torchtitan-flavor-a-list": (
        _torchtitan, TOML.replace('flavor = "debugmodel"', "flavor = [1]"), "model"),
    "torchtitan-flavor-a-table": (
        _torchtitan, TOML.replace('flavor = "debugmodel"', "flavor = {a = 1}"), "model"),
    "torchtitan-split-points-an-integer": (
        _torchtitan, TOML + "pipeline_parallel_split_points = 5\n",
        "pipeline_parallel_split_points"),
    "torchtitan-split-point-5000-digits": (
        _torchtitan, TOML + f'pipeline_parallel_split_points = ["layers.{"9" * 5000}"]\n',
        "pipeline_parallel_split_points"),
    "torchtitan-model-part-5000-digits": (
        _torchtitan, TOML + 'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
        f'["layers.{"9" * 5000}", "norm", "output"]]\n', "module_fqns_per_model_part"),
    "torchtitan-nested-arrays": (
        _torchtitan, "x = " + "[" * 3000 + "]" * 3000 + "\n" + TOML, "nested"),
    "torchtitan-nested-inline-tables": (
        _torchtitan, "x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n" + TOML, "nested"),
    "deepspeed-regex-does-not-compile": (
        _deepspeed, json.dumps(DS_JSON), "--pp-partition-method"),
    "deepspeed-num-layers-1e11": (_deepspeed, json.dumps(DS_JSON), "--num-layers"),
    "deepspeed-balanced-split-of-8000-layers": (_deepspeed, json.dumps(DS_JSON),
                                                "--pp-partition-method"),
}
DS_ARGS = {
    "deepspeed-regex-does-not-compile": MEGATRON + " --pp-partition-method 'type:['",
    "deepspeed-num-layers-1e11": _layers("99999999999"),
    "deepspeed-balanced-split-of-8000-layers": _layers("8000").replace(
        "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_odd_numbers_and_shapes_are_one_line(case, tmp_path, capsys):
    build, text, needle = REFUSED[case]
    argv = build(tmp_path, text, DS_ARGS[case]) if case in DS_ARGS else build(tmp_path, text)
    rc, out, err = cli(capsys, argv)
    assert_one_line(rc, err, 2, needle)
    assert out == ""


def test_the_balanced_split_is_refused_past_its_bound(monkeypatch):
    """The bound is the split's work, items^2 x parts: 4 items in 2 parts (32 steps) run
    under a bound of 100, 8 items in 2 parts (128) are refused, uniform splits never."""
    monkeypatch.setattr(ds, "MAX_BALANCED_STEPS", 100)
    parts = ds.partition_balanced([1, 2, 3, 4], 2)
    assert (parts[0], parts[-1], len(parts)) == (0, 4, 3)
    with pytest.raises(ValueError):
        ds.partition_balanced([1] * 8, 2)
    assert ds.method_parts("uniform", 400, False, None, 2)[-1] == len(ds.pipe_specs(400, False))


def test_export_past_the_bound_writes_the_partition_without_balancing(
        monkeypatch, tmp_path, capsys):
    """Past the bound, `export --to deepspeed` states the plan's stages as the JSON's
    pipeline.partition and never runs the balanced split (it would take minutes)."""
    def refuse(*_args):
        raise AssertionError("partition_balanced ran past its bound")
    monkeypatch.setattr(ds, "MAX_BALANCED_STEPS", 0)
    monkeypatch.setattr(ds, "partition_balanced", refuse)
    ds.method_parts.cache_clear()
    plan = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": A100_NODE,
            "global_batch": 2, "schedule": "1f1b",
            "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                           "stages": [{"layers": [0, 3], "devices": ["n/0"]},
                                      {"layers": [3, 8], "devices": ["n/1"]}]}]}
    path = _write(tmp_path, "p.json", json.dumps(plan))
    rc, out, err = cli(capsys, ["export", "--plan", path, "--to", "deepspeed"])
    ds.method_parts.cache_clear()
    assert rc == 0, err
    assert '"partition"' in out


def _shown(err: str) -> list[str]:
    return [w for w in SECRET_WORDS if w in err]


def test_a_private_file_as_deepspeed_json_is_not_quoted_in_the_notes(tmp_path, capsys):
    argv = ["import", "--from", "deepspeed", _write(tmp_path, "shadow", SECRET),
            "--args", _write(tmp_path, "a.sh", MEGATRON), "--cluster", _cluster(tmp_path)]
    rc, out, err = cli(capsys, argv)
    assert _shown(err + out) == [], err
    assert rc == 0 and "not read" in err and "(a key of" in err


def test_a_private_file_as_the_schedule_csv_is_not_quoted(tmp_path, capsys):
    secret = _write(tmp_path, "shadow", SECRET)
    rc, out, err = cli(capsys, _torchtitan(
        tmp_path, TOML + f'pipeline_parallel_schedule_csv = "{secret}"\n'))
    assert_one_line(rc, err, 2, "line 1")
    assert _shown(err) == [], err


def test_a_private_line_before_the_flags_is_not_quoted(tmp_path, capsys):
    rc, out, err = cli(capsys, _megatron(tmp_path, "probe-user:HASHHASH:19000 " + MEGATRON))
    assert rc == 0, err
    assert _shown(err + out) == [], err
    assert "positional (a key of" in err


@pytest.mark.parametrize("text", [MEGATRON + " --\x1b[2Jfoo 1",
                                  "torchrun --\x1b]0;title\x07 1 x.py " + MEGATRON],
                         ids=["script-flag", "launcher-flag"])
def test_names_in_the_notes_reach_the_terminal_escaped(text, tmp_path, capsys):
    rc, out, err = cli(capsys, _megatron(tmp_path, text))
    assert rc == 0, err
    assert "\x1b" not in err and "\x07" not in err
    assert "not read" in err


def test_a_plain_unknown_flag_is_still_named(tmp_path, capsys):
    rc, out, err = cli(capsys, _megatron(tmp_path, MEGATRON + " --made-up-flag 3"))
    assert rc == 0 and "--made-up-flag" in err


DROPPED_STOP = textwrap.dedent("""
    import os, signal, sys, time, weakref
    from hyperpipe.core import stopping
    from hyperpipe.core.errors import Stopped
    stopping.install()

    class Box:
        pass

    def callback(_ref):          # called from C: what it raises, Python prints and drops
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):
            pass

    try:
        with stopping.armed():
            box = Box()
            ref = weakref.ref(box, callback)
            del box
            start = time.monotonic()
            while time.monotonic() - start < 3:
                pass
        print("lost")
    except Stopped as exc:
        print("stopped", exc.signum)
""")


def test_a_stop_python_drops_in_a_callback_is_raised_again(tmp_path):
    """The raise lands in a weakref callback (as in logging's at-fork hook under a
    forking search): Python sends it to sys.unraisablehook; the stop must still come."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED_STOP)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.stdout.strip() == "stopped 15", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_a_stop_waits_out_a_pool_starting_but_not_a_pool_waiting():
    """A raise inside Thread.start or a process pool's spawning leaves the pool half built
    (its shutdown then fails or hangs); a raise in Future.result's wait is the stop a
    user expects. The first are deferred, the second is not."""
    import concurrent.futures._base as futures_base
    import concurrent.futures.process as futures_process
    import threading

    from hyperpipe.core import stopping
    assert stopping._fragile(threading.__file__, "start")
    assert stopping._fragile(futures_process.__file__, "_adjust_process_count")
    assert not stopping._fragile(futures_base.__file__, "result")
    assert not stopping._fragile(threading.__file__, "wait")
