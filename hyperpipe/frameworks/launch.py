"""A launch line read as a launcher, a script and the script's arguments.

The text may be one command or a file of arguments: backslash-newline continues a line,
``#`` starts a comment, and shell variables must already be expanded (``$TP`` is read as
a value and refused where a number is expected). A launch line of several commands
(``python prep.py && torchrun ... pretrain_gpt.py ...``, split at ``&&``, ``||``, ``;``,
``|`` and ``&`` written as words of their own, wherever the text names a ``*.py``
script) is read at its one training command (`_training_command`): the one that runs a
launcher, else a ``pretrain*.py`` script, else a script; two such are refused. Tokens
before the training script (its first ``*.py``) belong to the launcher: torchrun /
``python -m torch.distributed.run`` (``--nnodes``, ``--nproc-per-node``), DeepSpeed's
launcher (``--num_nodes``, ``--num_gpus``) and srun (``--ntasks``/``-n``, else
``--nodes``/``-N`` x ``--ntasks-per-node``), which give the world size. Long flags are
read in any case and with ``_`` or ``-``; a one-letter flag keeps its case (srun's
``-n`` tasks, ``-N`` nodes) and may carry its number attached (``-N2``). Everything after
is the script's arguments, read by `Args`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, key_name

# Launcher flags that give the world size, spelled as each launcher documents them
# (`_flag_name`): nodes and processes per node (torch.distributed.run's --nnodes and
# --nproc-per-node, also with underscores; deepspeed's launcher --num_nodes/--num_gpus;
# srun's --nodes/-N and --ntasks-per-node), and srun's total task count --ntasks/-n,
# which wins over nodes x tasks per node (srun(1): -n is the number of tasks, -N of nodes)
# unless each task runs torchrun or DeepSpeed's launcher (their per-node flags given).
_NODES = ("nnodes", "num-nodes", "nodes", "N")
_SPAWNERS = ("nproc-per-node", "num-gpus")     # a launcher's own processes per node
_PER_NODE = (*_SPAWNERS, "ntasks-per-node")
_TOTAL = ("ntasks", "n")


def _flag_name(token: str) -> str:
    """``--Num_GPUs`` -> ``num-gpus``: Megatron-LM and the launchers accept both spellings
    of a long flag; a one-letter flag keeps its case (srun's ``-n`` is not ``-N``)."""
    name = token.lstrip("-")
    return name if len(name) == 1 else name.replace("_", "-").lower()


def _split_attached(token: str) -> list[str]:
    """``-N2`` -> ``-N 2``: a one-letter flag with its number attached, as srun takes it."""
    m = re.fullmatch(r"(-[A-Za-z])([0-9]+)", token)
    return [m.group(1), m.group(2)] if m else [token]


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d*)?([eE][-+]?\d+)?", token)


def _tokens(text: str, where: str) -> list[str]:
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise BadInput(where, f"a launch line or arguments that split like a shell's ({exc})",
                       has_got=False) from None


# Shell operators that end a command, written as words of their own; a launch line is
# split at them (`_commands`).
_SEPARATORS = ("&&", "||", ";", "|", "&")
# Programs that start the training ranks: torchrun, DeepSpeed's launcher, srun, and
# torch.distributed.run/launch run as ``python -m``.
_LAUNCHERS = ("torchrun", "deepspeed", "srun", "torch.distributed.run",
              "torch.distributed.launch")


def _commands(text: str, where: str) -> list[list[str]]:
    """The commands of `text`, split at the operators (`_SEPARATORS`) written as words of
    their own, as launch lines write them (``prep && torchrun ...``; a ``;`` inside a word
    stays in it); an arguments file without a ``*.py`` script is one command, read as
    before."""
    tokens = _tokens(text, where)
    if not any(t.endswith(".py") for t in tokens):
        return [tokens]
    commands: list[list[str]] = [[]]
    for tok in tokens:
        if tok in _SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def _script(command: list[str]) -> int | None:
    """The index of the command's training script (its first ``*.py``), if any."""
    return next((i for i, t in enumerate(command) if t.endswith(".py")), None)


def _training_command(commands: list[list[str]], where: str) -> list[str]:
    """The command that trains: the one that runs a launcher (`_LAUNCHERS`, before its
    script), else the one that runs a ``pretrain*.py`` script, else one that runs a
    script; BadInput when two commands tie, since either could be the job."""
    if len(commands) == 1:
        return commands[0]

    def launches(c: list[str]) -> bool:
        return any(t.rsplit("/", 1)[-1] in _LAUNCHERS for t in c[:_script(c)])

    def pretrain(c: list[str]) -> bool:
        script = _script(c)
        return script is not None and c[script].rsplit("/", 1)[-1].startswith("pretrain")

    for kind, test in (("runs a launcher", launches), ("runs a pretrain*.py script",
                                                         pretrain),
                       ("runs a *.py script", lambda c: _script(c) is not None)):
        found = [c for c in commands if test(c)]
        if len(found) == 1:
            return found[0]
        if found:
            raise BadInput(f"{where}: launch line", f"one training command, the one that "
                           f"{kind} ({len(found)} of its {len(commands)} commands do: keep "
                           "the one to import)", has_got=False)
    return commands[-1]


def _options(tokens: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Flags to their values (the tokens up to the next flag; ``--x=1`` too), the last
    of a repeated flag winning, and the tokens before the first flag."""
    out: dict[str, list[str]] = {}
    loose: list[str] = []
    current: str | None = None
    for tok in (t for token in tokens for t in _split_attached(token)):
        if _is_flag(tok):
            name, eq, value = tok.partition("=")
            current = _flag_name(name)
            out[current] = [value] if eq else []
        elif current is None:
            loose.append(tok)
        else:
            out[current].append(tok)
    return out, loose


@dataclass
class Launch:
    """The launcher's world size (None when the text names no launcher that states it)
    and the script's arguments."""

    world_size: int | None
    args: Args
    launcher_unread: list[str] = field(default_factory=list)


def read_launch(text: str, where: str) -> Launch:
    """Split `text` (module docstring) into the launcher and the script's arguments."""
    tokens = _training_command(_commands(text, where), where)
    script = _script(tokens)
    launcher: dict[str, list[str]] = {}
    if script is not None:
        launcher, _ = _options(tokens[:script])
        tokens = tokens[script + 1:]
    options, loose = _options(tokens)
    world = None
    unread = []
    nodes = next((launcher[k] for k in _NODES if k in launcher), None)
    per_node = next((launcher[k] for k in _PER_NODE if k in launcher), None)
    total = next((launcher[k] for k in _TOTAL if k in launcher), None)
    # srun's task count, unless each task is a launcher that spawns its own processes
    # (`srun -n 2 torchrun --nnodes 2 --nproc-per-node 8`: 16 ranks)
    spawns = any(k in launcher for k in _SPAWNERS)
    if total is not None and not spawns:
        world = _int(total, where, "launcher tasks (srun --ntasks)")
    elif per_node is not None:
        count = _int(per_node, where, "launcher processes per node")
        world = count * (_int(nodes, where, "launcher nodes") if nodes is not None else 1)
    for key in launcher:
        # python's own switches (-u, -m) before the script say nothing about the job
        if key not in (*_NODES, *_PER_NODE, *_TOTAL, "u", "m"):
            unread.append(f"launcher --{key_name(key)}")
    args = Args(options, where)
    if loose:
        # each token by `key_name`: a file that is not a launch line (a private file's
        # `user:$6$hash:...` lines) is never quoted back
        shown = " ".join(key_name(t) for t in loose[:3])
        args.unread.append(f"positional {shown}{' ...' if len(loose) > 3 else ''}")
    return Launch(world, args, unread)


def _int(values: list[str] | None, where: str, what: str) -> int:
    text = values[0] if values else ""
    text = text.split(":")[-1]          # torchrun's --nnodes MIN:MAX: the most it starts
    # ASCII digits only: str.isdigit() takes '²', which int() refuses
    if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) < 1:
        raise BadInput(f"{where}: {what}", "a positive integer (expand shell variables "
                       "first)", text)
    return int(text)


class Args:
    """The script's arguments, read flag by flag; `unread_flags` names those nobody read."""

    def __init__(self, options: dict[str, list[str]], where: str):
        self.options = options
        self.where = where
        self.read: set[str] = set()
        self.unread: list[str] = []

    def has(self, name: str) -> bool:
        self.read.add(name)
        return name in self.options

    def flag(self, name: str) -> bool:
        """A switch (``--bf16``): present or not."""
        return self.has(name)

    def text(self, name: str, default: str | None = None) -> str | None:
        if not self.has(name):
            return default
        values = self.options[name]
        if len(values) != 1:
            raise BadInput(f"{self.where}: --{name}", "one value", " ".join(values) or None)
        return values[0]

    def integer(self, name: str, default: int | None = None, *, required: bool = False,
                allow_zero: bool = False, at_most: int = limits.MAX_INT) -> int | None:
        """Flag `name` as an integer in [0 or 1, `at_most`] (`default` when absent)."""
        value = self.text(name)
        if value is None:
            if required:
                raise BadInput(f"{self.where}: --{name}", "a value (the job must state it)",
                               has_got=False)
            return default
        try:
            number = int(value.replace("_", ""))
        except ValueError:
            number = -1
        if number < 0 or (number == 0 and not allow_zero):
            raise BadInput(f"{self.where}: --{name}", "a positive integer (expand shell "
                           "variables first)", value)
        if number > at_most:
            raise BadInput(f"{self.where}: --{name}", f"an integer of at most {at_most} "
                           "(hyperpipe.core.limits)", number)
        return number

    def number(self, name: str, default: float) -> float:
        value = self.text(name)
        if value is None:
            return default
        try:
            return float(value)
        except ValueError:
            raise BadInput(f"{self.where}: --{name}", "a number", value) from None

    def values(self, name: str) -> list[str]:
        self.has(name)
        return list(self.options.get(name, []))

    def unread_flags(self) -> list[str]:
        return self.unread + [f"--{key_name(k)}" for k in self.options if k not in self.read]
