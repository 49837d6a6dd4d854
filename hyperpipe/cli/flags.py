"""The flags several subcommands share, each declared here once, and the typed options
they become.

A command's module calls `add_*` to put a group on its parser and builds the matching
frozen record (`Workload`, `MemoryOptions`, `ProfileOptions`, `BackendOptions`) from the
parsed namespace. `as_flags` turns the option names that library errors give into the
flags a user typed (`FLAG_OF`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hyperpipe.cli import args as ca
from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, short
from hyperpipe.plan.stack import STACKS


def command(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand's parser: its help line doubles as its description."""
    return sub.add_parser(name, help=help_text, description=help_text)


@dataclass(frozen=True)
class Workload:
    """The cluster, model and batch that search and whatif plan for."""

    cluster: str           # built-in name or file
    model: str             # preset name or file
    global_batch: int      # samples per iteration

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> Workload:
        return cls(cluster=ns.cluster, model=ns.model, global_batch=ns.global_batch)


def add_workload(p: argparse.ArgumentParser, required: bool = True) -> None:
    """--cluster, --model and --global-batch; `required` False where another option
    (search's --start) can supply them."""
    p.add_argument("--cluster", type=ca.path, required=required,
                   help="built-in cluster name or YAML/JSON file")
    p.add_argument("--model", type=ca.path, required=required,
                   help="preset name or YAML/JSON file")
    p.add_argument("--global-batch", type=ca.BATCH, required=required,
                   help="samples per iteration")


@dataclass(frozen=True)
class MemoryOptions:
    """Activation recompute, sequence parallelism and the distributed optimizer; None
    leaves each to the plan (simulate) or to the search."""

    recompute: str | None = None
    sequence_parallel: bool | None = None
    distributed_optimizer: bool | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> MemoryOptions:
        return cls(recompute=ns.recompute, sequence_parallel=ns.sequence_parallel,
                   distributed_optimizer=ns.distributed_optimizer)


def add_memory(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("--recompute", choices=["none", "selective", "full"],
                   help=f"{verb} activation recompute on every stage")
    p.add_argument("--sequence-parallel", action="store_const", const=True,
                   help=f"{verb} sequence parallelism on tensor-parallel stages")
    p.add_argument("--distributed-optimizer", action="store_const", const=True,
                   help=f"{verb} the optimizer state sharded over data-parallel replicas")


def add_sharding(p: argparse.ArgumentParser, verb: str) -> None:
    """`--zero` (ZeRO stage, `hyperpipe.plan.plan.ZERO_STAGES`), `--cp` (context
    parallel degree of every stage) and `--ep` (expert-parallel degree of every stage,
    `StagePlan.ep`)."""
    p.add_argument("--zero", type=ca.count(0, 3), metavar="{0,1,2,3}",
                   help=f"{verb} the ZeRO stage: 1 shards the optimizer state over the "
                   "data-parallel group, 2 the gradients too, 3 the weights too (FSDP)")
    p.add_argument("--cp", type=ca.count(1, limits.MAX_CONTEXT_PARALLEL),
                   help=f"{verb} the context-parallel degree of every stage (the sequence "
                   "split over cp groups of tp devices, ring attention)")
    add_expert_parallel(p, verb)


def add_expert_parallel(p: argparse.ArgumentParser, verb: str) -> None:
    """`--ep` (expert-parallel degree of every stage, `StagePlan.ep`): in `add_sharding`
    for simulate and search, alone for whatif."""
    p.add_argument("--ep", type=ca.count(1, limits.MAX_NODE_DEVICES * 64),
                   help=f"{verb} the expert-parallel degree of every stage of an MoE model "
                   "(its routed experts split over ep of the data-parallel x context ranks "
                   "holding the stage; a divisor of the experts)")


@dataclass(frozen=True)
class ProfileOptions:
    """A calibration profile to price with, and whether a mismatch is allowed."""

    path: str | None = None
    allow_mismatch: bool = False

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ProfileOptions:
        return cls(path=ns.profile, allow_mismatch=ns.allow_profile_mismatch)


def add_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=ca.path, help="calibration profile JSON")
    p.add_argument("--allow-profile-mismatch", action="store_true", help="use --profile even "
                   "if it was measured on another model or lacks a device type")


def add_stack(p: argparse.ArgumentParser, what: str) -> None:
    """`--stack`: the training stack (`hyperpipe.plan.stack.STACKS`) `what` runs on."""
    p.add_argument("--stack", choices=list(STACKS), help=f"the training stack {what} runs "
                   "on: how it sends between stages and reduces gradients (default: the "
                   "plan's, or megatron-lm)")


def add_progress(p: argparse.ArgumentParser, bar: str = "progress bar on stderr") -> None:
    p.add_argument("--progress", action="store_true",
                   help=f"{bar} even when it is not a terminal")


def add_json(p: argparse.ArgumentParser, help_text: str = "one JSON object on stdout") -> None:
    p.add_argument("--json", action="store_true", help=help_text)


@dataclass(frozen=True)
class BackendOptions:
    """Where search and what-if work runs: local processes or a Ray cluster."""

    name: str = "local"
    ray_address: str | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> BackendOptions:
        return cls(name=ns.backend, ray_address=ns.ray_address)


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="where the work runs: local processes (--workers) or Ray "
                   "(pip install -e '.[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --backend ray: join this Ray cluster (default: start one here)")


@contextlib.contextmanager
def opened_backend(opts: BackendOptions, workers: int) -> Iterator[Any]:
    """The backend to hand to the library while the block runs: None for local (its
    `workers` processes are the search's own pool), the entered Ray backend otherwise."""
    from hyperpipe.search.backends import make_backend
    with contextlib.ExitStack() as stack:
        with as_flags():            # starting it names the flags it was given
            backend = stack.enter_context(make_backend(opts.name, workers=workers,
                                                       address=opts.ray_address))
        yield None if opts.name == "local" else backend


# Library errors name an option by its field (`micro_batch`) in their `where`, and in
# backquotes in their text; the command line names the flag the user typed.
FLAG_OF = {
    "cluster": "--cluster", "model": "--model", "global_batch": "--global-batch",
    "micro_batch": "--micro-batch", "schedule": "--schedule", "chunks": "--chunks",
    "pp": "--pp", "dp": "--dp", "tp": "--tp", "objective": "--objective",
    "recompute": "--recompute", "sequence_parallel": "--sequence-parallel",
    "distributed_optimizer": "--distributed-optimizer", "workers": "--workers",
    "top": "--top", "backend": "--backend", "ray_address": "--ray-address",
    "allow_profile_mismatch": "--allow-profile-mismatch", "window": "--window",
    "microbatches": "--microbatches", "trace": "--trace", "steps": "--steps", "to": "--to",
    "vary": "--vary", "failures": "--failures", "stack": "--stack",
    "zero": "--zero", "cp": "--cp", "ep": "--ep", "seq_len": "--seq-len",
    "mtbf": "--mtbf", "storage_bandwidth": "--storage-bandwidth",
    "checkpoint_size": "--checkpoint-size", "checkpoint_write_time": "--checkpoint-write-time",
    "restart_time": "--restart-time", "checkpoint_interval": "--checkpoint-interval",
}


def flag_where(where: str) -> str:
    """A library error's `where` with the option names in it as flags: the first word
    (``vary nodes.x.count`` -> ``--vary nodes.x.count``, ``model: seq_len`` ->
    ``--model: seq_len``, ``top/workers`` -> ``--top/--workers``) and, after it, a word
    that follows an ``x`` (``pp x dp x tp`` -> ``--pp x --dp x --tp``). Any other `where`
    is returned as is."""
    words = where.split(" ")
    head, colon = (words[0][:-1], ":") if words[0].endswith(":") else (words[0], "")
    first = head.split("/")
    if not all(part in FLAG_OF for part in first):
        return where
    out = ["/".join(FLAG_OF[part] for part in first) + colon]
    for before, word in zip(words[:-1], words[1:], strict=True):
        out.append(FLAG_OF.get(word, word) if before == "x" else word)
    return " ".join(out)


def flag_text(text: str) -> str:
    """`text` with each backquoted option name (`` `mtbf` ``) as its flag (``--mtbf``)."""
    return re.sub(r"`([a-z_]+)`", lambda m: FLAG_OF.get(m.group(1), m.group(0)), text)


@contextlib.contextmanager
def as_flags() -> Iterator[None]:
    """While the block runs, a BadInput naming options is raised again naming flags."""
    try:
        yield
    except BadInput as exc:
        where, expected = flag_where(exc.where), flag_text(exc.expected)
        got = flag_text(exc.got) if isinstance(exc.got, str) else exc.got
        if (where, expected, got) == (exc.where, exc.expected, exc.got):
            raise
        shown = exc.got is not None and str(exc).endswith(f", got {short(exc.got)}")
        raise BadInput(where, expected, got, has_got=shown) from None
