"""Helpers of the hostile-input corpus (issue 16): run the CLI in-process and check that
a case ends the way the contract says: exit 0 or 2 (1 for a genuine run failure naming
the rank), at most one line on stderr, no traceback, no temporary file left behind."""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from pathlib import Path

import pytest

from hyperpipe.cli import main

# The contract's 30 s, as CPU time of this process: on a shared machine (load 16 on
# 2 cores) wall time says more about the neighbours than about the case.
CASE_TIME_LIMIT_S = 30.0

# The smallest plan that runs for real: tiny-gpt over two ranks of one node.
CLUSTER = {"nodes": [{"name": "n", "device": "A100-80GB", "count": 2}]}
PLAN = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": CLUSTER,
        "global_batch": 2, "schedule": "gpipe",
        "pipelines": [{"micro_batch": 1, "num_microbatches": 2,
                       "stages": [{"layers": [0, 4], "devices": ["n/0"]},
                                  {"layers": [4, 8], "devices": ["n/1"]}]}]}


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """Run ``hyperpipe ARGV`` in this process; return (exit status, stdout, stderr)."""
    t0 = time.process_time()
    rc = main([str(a) for a in argv])
    elapsed = time.process_time() - t0
    out, err = capsys.readouterr()
    assert elapsed < CASE_TIME_LIMIT_S, (argv, elapsed)
    return rc, out, err


def assert_one_line(rc: int, err: str, want_rc: int = 2, *words: str) -> str:
    """The case ended with `want_rc` and one stderr line holding every word in `words`."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == want_rc, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def temp_files(folder: Path) -> list[str]:
    """Temporary files of the safe writer left anywhere under `folder`."""
    return sorted(str(p) for p in Path(folder).rglob("*.tmp"))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mkfifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.fixture(autouse=True)
def clean_case(tmp_path):
    """Every case of the corpus leaves no temporary file and no child process."""
    yield
    assert temp_files(tmp_path) == []
    assert multiprocessing.active_children() == []


# Small framework jobs that import cleanly (tests of `hyperpipe import` vary them)
MEGATRON = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --num-layers 4 "
            "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 256 "
            "--micro-batch-size 1 --global-batch-size 8")
TOML = """[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 4
seq_len = 64
[parallelism]
data_parallel_shard_degree = 1
data_parallel_replicate_degree = 4
pipeline_parallel_degree = 2
"""
DS_JSON = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8,
           "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}
