"""Fixed per-rank action orders replayed in the list scheduler's model.

`replay(c, rows, placement)` times one pipeline's per-rank orders with per-stage F, I, W
(and B) times from `PipeCosts`, fixed link delays between ranks and no contention: each
action starts when its rank is free and its input has arrived. It returns each action's
(ready, start, end) in seconds, or None when the orders deadlock or a rank's stashes
(held from F to W, or to B) exceed its budget in bytes. `schedule_makespan_s` is that
replay's end for a `Schedule`'s own orders with no memory cap: the analytic tier prices
the V kinds and synth with it, and schedule synthesis (`hyperpipe.synth`) judges its
local moves with it. Nothing here mutates its input.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

from hyperpipe.plan.schedule import Action, Schedule, stage_rank


@dataclass(frozen=True)
class PipeCosts:
    """Per stage k: f_s, i_s, w_s (seconds), stash_bytes; per boundary k (stage k to k+1):
    fwd_link_s and bwd_link_s (0 on one device); per rank: budget_bytes for stashes; per
    stage b_s, a whole backward's time (seconds; None: i_s + w_s), for orders with B's."""

    f_s: tuple[float, ...]
    i_s: tuple[float, ...]
    w_s: tuple[float, ...]
    stash_bytes: tuple[float, ...]
    fwd_link_s: tuple[float, ...]
    bwd_link_s: tuple[float, ...]
    budget_bytes: tuple[float, ...]
    b_s: tuple[float, ...] | None = None



EPS_S = 1e-12          # why: float sums of the same times in another order differ by ulps
Timing = dict[Action, tuple[float, float, float]]      # action -> (ready, start, end)


_CODE = {"F": 0, "I": 1, "W": 2, "B": 3}
RowTimes = list[list[tuple[float, float, float]]]   # [rank][position] -> (ready, start, end)


def replay(c: PipeCosts, rows: tuple[tuple[Action, ...], ...],
           placement: str) -> Timing | None:
    """Each action's (ready, start, end) in seconds, or None (deadlock, over budget)."""
    times = replay_rows(c, encode_rows(rows), placement)
    if times is None:
        return None
    return {a: t for row, row_t in zip(rows, times, strict=True)
            for a, t in zip(row, row_t, strict=True)}


def schedule_makespan_s(sched: Schedule, f_s: list[float], i_s: list[float],
                        w_s: list[float], b_s: list[float],
                        links: list[tuple[float, float]]) -> float:
    """When the last action of `sched`'s orders ends (seconds), in `replay`'s model with
    these per-stage F, I, W and B times, per-boundary (forward, backward) link delays and
    no memory cap. ValueError when the orders deadlock (a validated schedule does not)."""
    costs = PipeCosts(tuple(f_s), tuple(i_s), tuple(w_s), (0.0,) * len(f_s),
                      tuple(f for f, _ in links), tuple(b for _, b in links),
                      (float("inf"),) * sched.num_devices, tuple(b_s))
    times = replay_rows(costs, encode_rows(sched.actions), sched.placement)
    if times is None:
        raise ValueError(f"schedule {sched.kind} deadlocks on replay")
    return rows_score(times).makespan_s


def encode_rows(rows) -> list[tuple[tuple[int, int, int], ...]]:
    """Each action as (op code, stage, micro-batch): what `replay_rows` reads."""
    return [tuple((_CODE[a.op], a.stage, a.microbatch) for a in row) for row in rows]


def replay_rows(c: PipeCosts, rows, placement: str) -> RowTimes | None:
    """`replay` on encoded rows, each action's times at its position in its row (the
    inner loop of `improve`: plain lists, no hashing)."""
    state = Replayer(c, len(rows), placement, rows).run(rows)
    return None if state is None else state.times


@dataclass(slots=True)
class ReplayState:
    """A finished replay of `rows` (encoded): `times[d][i]` is (ready, start, end) of rank
    d's i-th action; `done_f`/`done_b` each (stage, micro-batch)'s F end and I-or-B end
    (index stage * micro-batches + mb). What `Replayer.rerun` starts from; it fills
    `live_after[d][i]` (rank d's stash bytes after its i-th action) when first asked."""

    rows: list
    times: RowTimes
    done_f: list
    done_b: list
    live_after: list[list[float]] | None = None


class Replayer:
    """`replay_rows` for one pipeline's costs, set up once (rank of each stage, link
    delays, durations, budgets), run on many orders of the same actions.

    `rerun(state, rows, d, to)` gives what `run(rows)` gives, bit for bit, when `rows`
    differ from the rows `state` replayed only on rank d from position `to` on (the
    same number of actions per rank, any of them; `to` < that number): every
    action that started before the old start of rank d's action `to` (T0) keeps its
    times. Why that is exact: such an action's inputs and rank predecessors all ended
    by its start, so before T0; every changed action started at or after T0 (a rank
    starts its actions in order), so none of them is among its ancestors, whose edges
    are unchanged; the replay's times are a function of that graph alone."""

    __slots__ = ("p", "n_st", "mbs", "in_f", "in_b", "dur", "stash", "budget", "last")

    def __init__(self, c: PipeCosts, p: int, placement: str, rows) -> None:
        self.p, self.n_st = p, len(c.f_s)
        rank_of = [stage_rank(k, p, placement) for k in range(self.n_st)]
        # what an input takes to arrive from the neighbouring stage (0 on the same rank)
        self.in_f = [0.0] + [0.0 if rank_of[k - 1] == rank_of[k] else c.fwd_link_s[k - 1]
                             for k in range(1, self.n_st)]
        self.in_b = [0.0 if rank_of[k + 1] == rank_of[k] else c.bwd_link_s[k]
                     for k in range(self.n_st - 1)] + [0.0]
        self.dur = (c.f_s, c.i_s, c.w_s,
                    c.b_s or [i + w for i, w in zip(c.i_s, c.w_s, strict=True)])
        self.stash = c.stash_bytes
        self.budget = [b * (1 + 1e-9) for b in c.budget_bytes]
        self.mbs = 1 + max((j for row in rows for _, _, j in row), default=0)
        self.last = self.n_st - 1

    def run(self, rows) -> ReplayState | None:
        """Replay `rows` from the start (None: deadlock or over a budget)."""
        p, size = self.p, self.n_st * self.mbs
        return self._advance(rows, [[] for _ in range(p)], [0.0] * p,
                             [None] * size, [None] * size)

    def rerun(self, state: ReplayState, rows, d: int, to: int,
              limit_s: float = float("inf")) -> ReplayState | None:
        """`run(rows)` from `state` (see the class doc for what `rows` may change); None
        also as soon as an action would end after `limit_s` (a caller that only wants
        orders ending by then stops there)."""
        t0, mbs = state.times[d][to][1], self.mbs
        keeps = [bisect_left(got, t0, hi=to if e == d else len(got), key=_start_of)
                 for e, got in enumerate(state.times)]
        if state.live_after is None:
            state.live_after = self._live_after(state.rows)
        live = [la[keep - 1] if keep else 0.0
                for la, keep in zip(state.live_after, keeps, strict=True)]
        kept = sum(keeps)
        if 2 * kept <= sum(map(len, state.times)):
            # few kept: their ends into empty tables
            size = self.n_st * mbs
            done_f, done_b = [None] * size, [None] * size
            old_f, old_b = state.done_f, state.done_b
            for row, keep in zip(state.rows, keeps, strict=True):
                for code, k, j in row[:keep]:
                    if code == 0:
                        done_f[k * mbs + j] = old_f[k * mbs + j]
                    elif code != 2:
                        done_b[k * mbs + j] = old_b[k * mbs + j]
        else:
            # most kept: the old tables, less what the old rows ran from T0 on
            done_f, done_b = state.done_f[:], state.done_b[:]
            for row, keep in zip(state.rows, keeps, strict=True):
                for code, k, j in row[keep:]:
                    if code == 0:
                        done_f[k * mbs + j] = None
                    elif code != 2:
                        done_b[k * mbs + j] = None
        out = [got[:keep] for got, keep in zip(state.times, keeps, strict=True)]
        return self._advance(rows, out, live, done_f, done_b, limit_s)

    def _live_after(self, rows) -> list[list[float]]:
        """Per rank, its stash bytes after each of its actions, summed as `_advance`
        sums them (so the same floats)."""
        stash, out = self.stash, []
        for row in rows:
            live, mine = 0.0, []
            for code, k, _ in row:
                if code == 0:
                    live += stash[k]
                elif code != 1:
                    live -= stash[k]
                mine.append(live)
            out.append(mine)
        return out

    def _advance(self, rows, out: RowTimes, live: list[float], done_f, done_b,
                 limit_s: float = float("inf")) -> ReplayState | None:
        """Run every rank from where `out` stops (`live`: each rank's stash bytes
        there) until nothing can move."""
        p, mbs, last = self.p, self.mbs, self.last
        in_f, in_b, dur, stash, budget = self.in_f, self.in_b, self.dur, self.stash, \
            self.budget
        ptr = [len(got) for got in out]
        free = [got[-1][2] if got else 0.0 for got in out]
        moved = True
        while moved:
            moved = False
            for d in range(p):
                row, got, at = rows[d], out[d], ptr[d]
                while at < len(row):
                    code, k, j = row[at]
                    if code == 0:
                        if k == 0:
                            r = 0.0
                        else:
                            t = done_f[(k - 1) * mbs + j]
                            if t is None:
                                break
                            r = t + in_f[k]
                    elif code == 2:
                        r = done_b[k * mbs + j]
                        if r is None:
                            break
                    elif k == last:
                        r = done_f[k * mbs + j]
                        if r is None:
                            break
                    else:
                        t = done_b[(k + 1) * mbs + j]
                        if t is None:
                            break
                        r = t + in_b[k]
                    start = free[d] if free[d] > r else r
                    free[d] = end = start + dur[code][k]
                    if end > limit_s:
                        return None
                    got.append((r, start, end))
                    if code == 0:
                        done_f[k * mbs + j] = end
                        live[d] += stash[k]
                        if live[d] > budget[d]:
                            return None
                    else:
                        if code != 2:
                            done_b[k * mbs + j] = end
                        if code != 1:
                            live[d] -= stash[k]
                    at += 1
                    moved = True
                ptr[d] = at
        if any(ptr[d] != len(rows[d]) for d in range(p)):
            return None
        return ReplayState(rows, out, done_f, done_b)


def _start_of(t: tuple[float, float, float]) -> float:
    return t[1]


class RowScore(NamedTuple):
    """How good a replay is, compared as a tuple: makespan first, then the ranks' ends."""

    makespan_s: float              # the last rank's end
    ends_sum_s: float              # every rank's end, summed


def rows_score(times: RowTimes) -> RowScore:
    ends = [end for row_t in times if row_t for _, _, end in row_t[-1:]]
    return RowScore(max(ends), sum(ends))
