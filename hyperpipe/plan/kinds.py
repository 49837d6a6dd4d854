"""The registry of schedule kinds: one frozen `ScheduleKind` record per kind, by name.

A record says what a kind can do: its generator (a pure function of p ranks, m
micro-batches and, when it `takes_chunks`, v chunks; None for `synth`, whose plans carry
their own per-device action lists), its default chunk count (the only one unless it takes
chunks), its placement (``loop`` or ``v``, see `schedule.stage_rank`), whether it splits
the backward into I and W, its closed form of the stashes a rank holds (None: the
analytic tier replays the IR instead), and the names frameworks know it by.

`KINDS` maps names to records in listing order; `schedule_kind` finds one (BadInput for
an unknown name); `generate` builds a generated kind's schedule, memoised (schedules are
immutable). Adding a kind touches only its generator and its record here. Code outside
this module and the generators asks the record, never compares kind names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput, InfeasiblePlan
from hyperpipe.plan import generators_loop as loop
from hyperpipe.plan.generators_v import dualpipe_v, dualpipe_v_built, zb_v, zb_v_built
from hyperpipe.plan.schedule import PLACEMENTS, Schedule

PeakInFlight = Callable[[int, int, int, int], int]     # (p, m, v, rank) -> stashes held


@dataclass(frozen=True)
class ScheduleKind:
    """What one schedule kind can do (see the module docstring)."""

    name: str
    description: str                 # one line, as `hyperpipe list schedules` prints it
    generator: Callable[..., Schedule] | None     # (p, m) or (p, m, v); None: plan's own
    takes_chunks: bool = False       # any chunk count >= 1; else exactly `default_chunks`
    default_chunks: int = 1          # chunks (stages per device) when none is given
    placement: str = "loop"          # "loop" or "v"; synth reads it off the plan's devices
    splits_backward: bool = False    # runs I and W apart (synth: read off its actions)
    peak_in_flight: PeakInFlight | None = None    # closed form; None: read off the IR
    # closed form of the forwards a rank runs before the backward (B, or I when split)
    # of its oldest micro-batch, the one whose gradient it sends on; None: peak_in_flight
    forwards_ahead: PeakInFlight | None = None
    torch_schedule: str | None = None     # torch.distributed.pipelining get_schedule_class
    runs_in: frozenset[str] = frozenset()  # frameworks whose own schedule is this kind
    # pairs one micro-batch's forward with another's backward on a rank, so that one's
    # expert all-to-all runs under the other's compute (DualPipe, DeepSeek-V3 technical
    # report, arXiv 2412.19437, sec. 3.2.1)
    overlaps_alltoall: bool = False
    # (p, m) -> micro-batches its generator builds before dropping phantoms; None: m
    built_microbatches: Callable[[int, int], int] | None = None

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def carries_actions(self) -> bool:
        """Whether plans of this kind carry their own action lists (no generator)."""
        return self.generator is None

    @property
    def closed_form(self) -> bool:
        """Whether the analytic tier prices it by closed forms rather than off the IR."""
        return self.peak_in_flight is not None

    def ahead(self, p: int, m: int, v: int, rank: int) -> int:
        """How many forwards `rank` runs before the backward of its oldest micro-batch
        (`forwards_ahead`, else `peak_in_flight`; closed-form kinds only)."""
        closed = self.forwards_ahead or self.peak_in_flight
        if closed is None:
            raise ValueError(f"schedule kind {self.name!r} has no closed form")
        return closed(p, m, v, rank)

    def allows_chunks(self, chunks: int) -> bool:
        """Whether this kind can place `chunks` stages per device."""
        return self.takes_chunks or chunks == self.default_chunks

    def chunks_rule(self) -> str:
        """What a chunk count must be for this kind, as a refusal's expectation."""
        others = " and ".join(k.name for k in KINDS.values() if k.takes_chunks)
        return (f"{self.default_chunks} for schedule {self.name!r} (only {others} take "
                "other chunk counts)")


SYNTH = "synth"          # the kind whose plans carry their own actions (`schedule.actions`)
DEFAULT_KIND = "1f1b"    # what a plan runs when nobody chose: Megatron-LM's default

KINDS: Mapping[str, ScheduleKind] = MappingProxyType({k.name: k for k in (
    ScheduleKind("gpipe", "all forwards, then all backwards (GPipe); stashes every "
                 "micro-batch", loop.gpipe, peak_in_flight=loop.gpipe_peak,
                 torch_schedule="GPipe"),
    ScheduleKind("1f1b", "one forward, one backward in steady state (PipeDream-Flush / "
                 "Megatron)", loop.one_f_one_b, peak_in_flight=loop.one_f_one_b_peak,
                 torch_schedule="1F1B", runs_in=frozenset({"megatron", "deepspeed"})),
    ScheduleKind("interleaved-1f1b", "1f1b over v chunks per device (Megatron interleaved; "
                 "--chunks v)", loop.interleaved_1f1b, takes_chunks=True,
                 peak_in_flight=loop.interleaved_1f1b_peak,
                 torch_schedule="Interleaved1F1B", runs_in=frozenset({"megatron"}),
                 built_microbatches=loop.interleaved_built),
    ScheduleKind("zb-h1", "zero-bubble H1: backward split into I (input grad) and W (weight "
                 "grad)", loop.zb_h1, splits_backward=True, peak_in_flight=loop.zb_h1_peak,
                 forwards_ahead=loop.one_f_one_b_peak),
    ScheduleKind("zb-v", "zero-bubble V: 2 chunks per device placed in a V", zb_v,
                 default_chunks=2, placement="v", splits_backward=True,
                 torch_schedule="ZBVZeroBubble", built_microbatches=zb_v_built),
    ScheduleKind("dualpipe-v", "DualPipe's V-shaped variant: 2 chunks per device",
                 dualpipe_v, default_chunks=2, placement="v", splits_backward=True,
                 torch_schedule="DualPipeV", overlaps_alltoall=True,
                 built_microbatches=dualpipe_v_built),
    ScheduleKind(SYNTH, "synthesised for one plan by the simulator (plan schedule.actions)",
                 None, takes_chunks=True),
)})

# The kinds with a generator, in listing order (every kind but synth).
GENERATED_KINDS: tuple[str, ...] = tuple(n for n, k in KINDS.items() if not k.carries_actions)


def schedule_kind(name: str) -> ScheduleKind:
    """The record of kind `name`; BadInput naming every kind when there is none."""
    kind = KINDS.get(name)
    if kind is None:
        raise BadInput("schedule kind", f"one of {', '.join(KINDS)}", name)
    return kind


def default_chunks(name: str) -> int:
    """Chunks per device when none is given: the kind's default (2 for the V kinds), and 1
    for a name that is no kind (loaders read it before the plan check names the error)."""
    kind = KINDS.get(name)
    return 1 if kind is None else kind.default_chunks


def generate(kind: str, num_devices: int, num_microbatches: int,
             chunks: int | None = None) -> Schedule:
    """Build the `kind` schedule for p = num_devices, m = num_microbatches, v = chunks
    (None: the kind's default, 2 for the V kinds, else 1).

    Raises BadInput for a kind without a generator, non-positive counts, or a chunk count
    the kind cannot take (1 for single-stage kinds, 2 for the V kinds), InfeasiblePlan
    over the action limit. Memoised: a search simulates the same shapes many times.
    """
    if chunks is None:
        chunks = default_chunks(kind)
    return _generate(kind, num_devices, num_microbatches, chunks)


def over_action_limit(kind: str, num_devices: int, num_microbatches: int,
                      chunks: int) -> str | None:
    """Why a schedule of this shape is not built (over `limits.MAX_SCHEDULE_ACTIONS`,
    counting F, I and W per stage and micro-batch its generator builds, phantoms
    included: `ScheduleKind.built_microbatches`), or None when it is within it."""
    built = KINDS[kind].built_microbatches if kind in KINDS else None
    n = built(num_devices, num_microbatches) if built is not None else num_microbatches
    actions = 3 * num_devices * chunks * n
    if actions <= limits.MAX_SCHEDULE_ACTIONS:
        return None
    padded = f" (built as {n})" if n != num_microbatches else ""
    return (f"a {kind} schedule of {num_devices} devices x {chunks} chunks x "
            f"{num_microbatches} micro-batches{padded} (up to {actions} actions) is over "
            f"the limit of {limits.MAX_SCHEDULE_ACTIONS} actions (hyperpipe.core.limits)")


@lru_cache(maxsize=256)
def _generate(name: str, num_devices: int, num_microbatches: int, chunks: int) -> Schedule:
    if name not in GENERATED_KINDS:
        raise BadInput("schedule kind", f"one of {', '.join(GENERATED_KINDS)}", name)
    kind = KINDS[name]
    for what, value in (
        ("devices", num_devices),
        ("microbatches", num_microbatches),
        ("chunks", chunks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInput(f"schedule {what}", "a positive integer", value)
    over = over_action_limit(name, num_devices, num_microbatches, chunks)
    if over:
        raise InfeasiblePlan(over)
    if kind.takes_chunks:
        return kind.generator(num_devices, num_microbatches, chunks)
    if chunks != kind.default_chunks:
        what = "two stages per device in a V" if kind.default_chunks == 2 else \
            "one stage per device"
        raise BadInput(f"schedule chunks for kind {name!r}", f"{kind.default_chunks} "
                       f"({what})", chunks)
    return kind.generator(num_devices, num_microbatches)
