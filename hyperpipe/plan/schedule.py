"""The schedule IR: per-device ordered actions, their text forms, dependencies, validator.

For every pipeline rank (device) a schedule lists the compute actions it runs, in order.
An action ``(stage, op, microbatch)`` prints like torch's ``_Action``: ``2F0`` is the
forward of micro-batch 0 on stage 2. Ops keep torch.distributed.pipelining's names: ``F``
forward, ``B`` full backward, ``I`` input-gradient backward (the zero-bubble paper's "B"),
``W`` weight-gradient backward (any time after its ``I``). With p devices and v chunks
there are p·v stages, placed `loop` (stage k on device k % p) or `v` (chunks alternate
direction: device d holds stages d and 2p - 1 - d); see `stage_rank`. Communication is
not written in the IR: it follows from stage adjacency.

    >>> s = Schedule.from_text("0: 0F0 1F0 1B0 0B0", kind="custom")
    >>> s.num_stages, s.chunks, str(s.actions[0][2])
    (2, 2, '1B0')
    >>> validate(s)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hyperpipe.core.errors import BadInput

OPS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")
# ASCII digits only, at most 9 of each (every stage and micro-batch limit is below 10^9):
# int() of a 5,000-digit string raises ValueError, and \d matches non-ASCII digits.
_ACTION_RE = re.compile(r"([0-9]{1,9})([FBIW])([0-9]{1,9})")


class ScheduleError(BadInput):
    """A schedule that cannot run. str() is one line; `.details` is the rank x step grid.

    The grid has one row per step and one column per rank, like torch's
    ``_format_pipeline_order``, with the offending cells written ``>>2F0<<``.
    """

    def __init__(
        self,
        where: str,
        expected: str,
        got: object = None,
        *,
        has_got: bool = True,
        details: str = "",
        got_text: str | None = None,
    ):
        super().__init__(where, expected, got, has_got=has_got)
        self.details = details
        if got_text is not None:
            # Our own descriptions (stuck actions, duplicates) print verbatim, untruncated.
            self.args = (f"{where}: expected {expected}, got {got_text}",)


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: `op` on micro-batch `microbatch` of pipeline stage `stage`.

    Sorting orders by (stage, op, microbatch). The text form is torch's: ``2F0``.
    """

    stage: int
    op: str
    microbatch: int

    def __post_init__(self) -> None:
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"action {name}", "a non-negative integer", value)
        if self.op not in OPS:
            raise ScheduleError("action op", f"one of {', '.join(OPS)}", self.op)

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    @staticmethod
    def from_str(text: str) -> Action:
        """Parse ``"2F0"`` (stage, op, micro-batch); raises ScheduleError on anything else."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                "action", "text like '2F0' (stage, op in F/B/I/W, micro-batch)", text
            )
        return Action(int(match[1]), match[2], int(match[3]))


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The rank (0..p-1) holding `stage` of a pipeline of p ranks under `placement`."""
    chunk, i = divmod(stage, p)
    return p - 1 - i if placement == "v" and chunk % 2 else i


def rank_stages(d: int, p: int, v: int, placement: str = "loop") -> tuple[int, ...]:
    """The stages rank d holds, chunk 0 first: ``(d, d + p, ...)`` looped, ``(d, 2p-1-d)``
    in a V."""
    return tuple(c * p + (p - 1 - d if placement == "v" and c % 2 else d) for c in range(v))


@dataclass(frozen=True)
class Schedule:
    """Per-device action lists for `num_devices` ranks, `num_stages` stages, `num_microbatches`.

    `actions[d]` is the order rank `d` runs its actions in; `placement` (``loop`` or ``v``)
    says which stages rank d holds. Lists given to the constructor are frozen into
    tuples. Construction checks only the shape; `validate` checks the rest.
    """

    kind: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        for name in ("num_devices", "num_stages", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"schedule {name}", "a positive integer", value)
        if self.num_stages % self.num_devices != 0:
            raise ScheduleError(
                "schedule num_stages",
                f"a multiple of num_devices={self.num_devices} (looped placement)",
                self.num_stages,
            )
        if self.placement not in PLACEMENTS:
            raise ScheduleError("schedule placement", f"one of {', '.join(PLACEMENTS)}",
                                self.placement)
        frozen = tuple(tuple(row) for row in self.actions)
        if len(frozen) != self.num_devices:
            raise ScheduleError("schedule actions", f"{self.num_devices} device rows", len(frozen))
        for d, row in enumerate(frozen):
            for step, action in enumerate(row):
                if not isinstance(action, Action):
                    raise ScheduleError(f"schedule actions[{d}][{step}]", "an Action", action)
        object.__setattr__(self, "actions", frozen)

    @property
    def chunks(self) -> int:
        """Stages per device (v)."""
        return self.num_stages // self.num_devices

    def device_of(self, stage: int) -> int:
        """The rank that holds `stage` under this schedule's placement."""
        return stage_rank(stage, self.num_devices, self.placement)

    def to_text(self) -> str:
        """One line per device: ``"0: 0F0 0F1 0B0 0B1"``. `from_text` reads it back."""
        lines = []
        for d, row in enumerate(self.actions):
            lines.append(" ".join([f"{d}:", *map(str, row)]))
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(
        text: str, *, kind: str = "custom", num_microbatches: int | None = None,
        placement: str | None = None,
    ) -> Schedule:
        """Parse `to_text` output. Blank lines and lines starting with ``#`` are skipped.

        The device count is the number of lines; the stage count is the highest stage + 1
        rounded up to a multiple of it; the micro-batch count, unless given, is the highest
        micro-batch + 1; the placement, unless given, is ``v`` when every action sits on
        its V rank but not every one on its looped rank, else ``loop``.
        """
        rows: list[tuple[Action, ...]] = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, rest = line.partition(":")
            if not sep or head.strip() != str(len(rows)):
                raise ScheduleError(
                    f"schedule text line {lineno}", f"'{len(rows)}: <actions>'", line
                )
            row = []
            for token in rest.split():
                try:
                    row.append(Action.from_str(token))
                except ScheduleError as err:
                    raise ScheduleError(
                        f"schedule text line {lineno}", err.expected, token
                    ) from None
            rows.append(tuple(row))
        if not rows:
            raise ScheduleError("schedule text", "at least one device line", text)
        every = [a for row in rows for a in row]
        p = len(rows)
        top_stage = max((a.stage for a in every), default=0)
        num_stages = (top_stage // p + 1) * p
        if num_microbatches is None:
            num_microbatches = max((a.microbatch for a in every), default=0) + 1
        if placement is None:
            placement = infer_placement(rows)
        return Schedule(kind, p, num_stages, num_microbatches, tuple(rows), placement)

    def to_torch_csv(self) -> str:
        """The compute-only CSV that torch's ``_load_csv`` reads: one row per rank."""
        return "".join(",".join(map(str, row)) + "\n" for row in self.actions)

    def to_torch_actions(self) -> dict[int, list]:
        """The same schedule as torch ``_Action`` lists, keyed by rank (imports torch)."""
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        return {
            d: [_Action(a.stage, _ComputationType(a.op), a.microbatch) for a in row]
            for d, row in enumerate(self.actions)
        }


def infer_placement(rows: Sequence[Sequence[Action]]) -> str:
    """``v`` when every action of `rows` (one per rank) sits on its V rank and some
    action is off its looped rank; else ``loop``."""
    p = len(rows)

    def fits(placement: str) -> bool:
        return all(stage_rank(a.stage, p, placement) == d
                   for d, row in enumerate(rows) for a in row)

    return "v" if not fits("loop") and fits("v") else "loop"


def dependencies(schedule: Schedule) -> dict[Action, tuple[Action, ...]]:
    """For every action in `schedule`, the actions it must wait for.

    F(s,m) waits for F(s-1,m); B or I (s,m) waits for F(s,m) and for the B or I of
    (s+1,m), whichever the schedule holds; W(s,m) waits for I(s,m). Data movement between
    devices is implied by these edges. Insertion order follows the schedule (device, step).
    """
    present = _by_key(schedule)

    def action(s: int, op: str, mb: int) -> Action:      # the schedule's own, if held
        got = present.get((s, op, mb))
        return got if got is not None else Action(s, op, mb)

    last = schedule.num_stages - 1
    deps: dict[Action, tuple[Action, ...]] = {}
    for row in schedule.actions:
        for a in row:
            s, mb = a.stage, a.microbatch
            if a.op == "F":
                need = (action(s - 1, "F", mb),) if s > 0 else ()
            elif a.op in ("B", "I"):
                need = (action(s, "F", mb),)
                if s < last:
                    grad_in = "I" if (s + 1, "I", mb) in present else "B"
                    need += (action(s + 1, grad_in, mb),)
            else:
                need = (action(s, "I", mb),)
            deps[a] = need
    return deps


def _by_key(schedule: Schedule) -> dict[tuple[int, str, int], Action]:
    """The schedule's actions by (stage, op, micro-batch): looked up without building
    (and checking) a new `Action` each time."""
    return {(a.stage, a.op, a.microbatch): a for row in schedule.actions for a in row}


def format_grid(actions: Sequence[Sequence[object]], marks: Iterable[tuple[int, int]] = ()) -> str:
    """A step (row) x rank (column) grid of `actions`; cells in `marks` (rank, step) marked."""
    marked = set(marks)
    steps = max((len(row) for row in actions), default=0)
    cells = [
        [
            (f">>{row[i]}<<" if (d, i) in marked else str(row[i])) if i < len(row) else ""
            for i in range(steps)
        ]
        for d, row in enumerate(actions)
    ]
    label_w = len(f"step {max(steps - 1, 0)}")
    widths = [max([len(f"rank {d}"), *map(len, col)]) for d, col in enumerate(cells)]
    header = " " * (label_w + 2) + " ".join(f"rank {d}".ljust(w) for d, w in enumerate(widths))
    lines = [header.rstrip()]
    for i in range(steps):
        row = " ".join(cells[d][i].ljust(widths[d]) for d in range(len(cells)))
        flag = "  <-- here" if any(st == i for _, st in marked) else ""
        lines.append(f"step {i}".ljust(label_w) + ": " + row.rstrip() + flag)
    return "\n".join(lines) + "\n"


def _fail(schedule: Schedule, where: str, expected: str, got: object, marks=()) -> ScheduleError:
    return ScheduleError(
        f"{schedule.kind} schedule: {where}",
        expected,
        got,
        details=format_grid(schedule.actions, marks),
        got_text=got if isinstance(got, str) else None,
    )


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank can run its list to the end.

    Checks, in order: ops and stage / micro-batch ranges, placement (`stage_rank`),
    duplicates, completeness (each (stage, micro-batch) has one F and either one
    B or one I plus one W), same-device order (F before its B/I, I before its W), and
    cross-device progress (a simulation where each rank runs its list in order as soon as
    the dependencies are done; if it gets stuck, the message names each stuck action and
    what it waits for).
    """
    n_st, n_mb = schedule.num_stages, schedule.num_microbatches
    position: dict[Action, tuple[int, int]] = {}
    for d, row in enumerate(schedule.actions):
        for step, a in enumerate(row):
            where = f"rank {d} step {step} ({a})"
            if a.op not in OPS:
                raise _fail(schedule, where, f"op in {OPS}", a.op, [(d, step)])
            if not 0 <= a.stage < n_st:
                raise _fail(schedule, where, f"stage in [0, {n_st})", a.stage, [(d, step)])
            if not 0 <= a.microbatch < n_mb:
                raise _fail(
                    schedule, where, f"micro-batch in [0, {n_mb})", a.microbatch, [(d, step)]
                )
            home = schedule.device_of(a.stage)
            if home != d:
                raise _fail(
                    schedule,
                    where,
                    f"stage {a.stage} on rank {home} ({schedule.placement} placement)",
                    f"rank {d}",
                    [(d, step)],
                )
            if a in position:
                first = position[a]
                raise _fail(
                    schedule,
                    where,
                    "each action once",
                    f"duplicate of rank {first[0]} step {first[1]}",
                    [first, (d, step)],
                )
            position[a] = (d, step)

    held = _by_key(schedule)
    for s in range(n_st):
        for mb in range(n_mb):
            have = {op for op in OPS if (s, op, mb) in held}
            if have not in ({"F", "B"}, {"F", "I", "W"}):
                marks = [position[Action(s, op, mb)] for op in sorted(have)]
                raise _fail(
                    schedule,
                    f"stage {s} micro-batch {mb}",
                    "actions F+B or F+I+W",
                    "+".join(op for op in OPS if op in have) or "none",
                    marks,
                )

    for a, (d, step) in position.items():
        before = {"B": "F", "I": "F", "W": "I"}.get(a.op)
        if before is None:
            continue
        other = held[a.stage, before, a.microbatch]
        if position[other][1] > step:
            raise _fail(
                schedule,
                f"rank {d} step {step} ({a})",
                f"{other} earlier on the rank",
                f"{other} at step {position[other][1]}",
                [(d, step), position[other]],
            )

    _check_progress(schedule, dependencies(schedule))


def rank_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activation stashes held at once: from an
    F until the pair's B, or its W when the backward is split."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += 1 if a.op == "F" else -1 if a.op in "BW" else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def progress_order(schedule: Schedule, deps: dict[Action, tuple[Action, ...]] | None = None
                   ) -> tuple[list[Action], list[int]]:
    """Run every rank's list in order, each action once its dependencies are done.

    Returns the actions in the order they could run (each after its dependencies, and
    after the earlier actions of its rank) and how far each rank got: a rank short of
    the end of its list is stuck. O(actions): a rank whose next action waits parks on
    the first dependency not done, and is woken when that one runs."""
    deps = dependencies(schedule) if deps is None else deps
    done: set[Action] = set()
    order: list[Action] = []
    cursor = [0] * schedule.num_devices
    parked: dict[Action, list[int]] = {}        # action -> the ranks waiting for it
    ready = list(range(schedule.num_devices))
    ready.reverse()                             # rank 0 first
    while ready:
        d = ready.pop()
        row = schedule.actions[d]
        while cursor[d] < len(row):
            a = row[cursor[d]]
            waits = next((x for x in deps[a] if x not in done), None)
            if waits is not None:
                parked.setdefault(waits, []).append(d)
                break
            done.add(a)
            order.append(a)
            cursor[d] += 1
            ready.extend(parked.pop(a, ()))
    return order, cursor


def _check_progress(schedule: Schedule, deps: dict[Action, tuple[Action, ...]]) -> None:
    order, cursor = progress_order(schedule, deps)
    done = set(order)
    stuck = [(d, cursor[d]) for d, row in enumerate(schedule.actions) if cursor[d] < len(row)]
    if stuck:
        parts = []
        for d, step in stuck:
            a = schedule.actions[d][step]
            waits = " ".join(str(x) for x in deps[a] if x not in done)
            parts.append(f"rank {d} step {step} {a} waits for {waits}")
        raise _fail(schedule, "deadlock", "every rank to make progress", "; ".join(parts), stuck)
