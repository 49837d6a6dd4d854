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
    `live_after[d][i]` and `work_after[d][i]` (rank d's stash bytes and busy seconds
    after its i-th action) when first asked."""

    rows: list
    times: RowTimes
    done_f: list
    done_b: list
    live_after: list[list[float]] | None = None
    work_after: list[list[float]] | None = None
    timed: int = 0             # actions this (re)run timed; the others it kept or copied


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
    are unchanged; the replay's times are a function of that graph alone.

    It also stops early: once every rank's last timed action ends when it ended before
    (rank d past the positions that differ) and no end that differs from before is still
    to be read by an action not yet timed, every action left has the inputs it had, so
    its old times, copied rather than timed."""

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
        also as soon as some rank is sure to end after `limit_s`: an action ends after
        it, or would with the rank's actions left run back to back (a caller that only
        wants orders ending by then stops there)."""
        t0, mbs = state.times[d][to][1], self.mbs
        keeps = [bisect_left(got, t0, hi=to if e == d else len(got), key=_start_of)
                 for e, got in enumerate(state.times)]
        if state.live_after is None:
            state.live_after, state.work_after = self._prefixes(state.rows)
        live = [la[keep - 1] if keep else 0.0
                for la, keep in zip(state.live_after, keeps, strict=True)]
        # each rank's busy seconds from its first action not kept on (the same actions
        # in any order: positions before `to` are unchanged)
        left = [wa[-1] - wa[keep - 1] if keep else wa[-1] if wa else 0.0
                for wa, keep in zip(state.work_after, keeps, strict=True)]
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
        # rank d's row is the old one again from position `same` on
        same, new_row, old_row = len(rows[d]), rows[d], state.rows[d]
        while same > to and new_row[same - 1] == old_row[same - 1]:
            same -= 1
        return self._advance(rows, out, live, done_f, done_b, limit_s,
                             _Before(state, d, same, left))

    def _prefixes(self, rows) -> tuple[list[list[float]], list[list[float]]]:
        """Per rank, its stash bytes after each of its actions, summed as `_advance`
        sums them (so the same floats), and its busy seconds by then."""
        stash, dur, lives, works = self.stash, self.dur, [], []
        for row in rows:
            live, work, mine, busy = 0.0, 0.0, [], []
            for code, k, _ in row:
                if code == 0:
                    live += stash[k]
                elif code != 1:
                    live -= stash[k]
                work += dur[code][k]
                mine.append(live)
                busy.append(work)
            lives.append(mine)
            works.append(busy)
        return lives, works

    def _advance(self, rows, out: RowTimes, live: list[float], done_f, done_b,
                 limit_s: float = float("inf"), before: _Before | None = None
                 ) -> ReplayState | None:
        """Run every rank from where `out` stops (`live`: each rank's stash bytes
        there) until nothing can move; with `before` (a rerun), stop as soon as what is
        left would run as it did there (see the class doc)."""
        p, mbs, last = self.p, self.mbs, self.last
        in_f, in_b, dur, stash, budget = self.in_f, self.in_b, self.dur, self.stash, \
            self.budget
        ptr = [len(got) for got in out]
        start_ptr = sum(ptr)
        free = [got[-1][2] if got else 0.0 for got in out]
        track = before is not None
        if track:
            # a rank sure to end past this (its actions left back to back) cannot end by
            # `limit_s`; the margin covers the rounding of the sums (relative 1e-9)
            left, cut = before.left[:], limit_s + 1e-9 * abs(limit_s)
            old_t, old_f, old_b = before.state.times, before.state.done_f, \
                before.state.done_b
            moved_d, same = before.rank, before.same
            # ranks whose last timed action ends otherwise than before (rank d until
            # past its changed positions), and the reads still to come of ends that
            # differ from before (diff_f, diff_b: which)
            dirty = [e == moved_d for e in range(p)]
            n_dirty, reads, diff_f, diff_b = 1, 0, set(), set()
        moved = True
        while moved:
            moved = False
            for d in range(p):
                row, got, at = rows[d], out[d], ptr[d]
                while at < len(row):
                    code, k, j = row[at]
                    # the end this action reads (`src` of `done`; none for stage 0's F)
                    if code == 0:
                        if k == 0:
                            r, src = 0.0, -1
                        else:
                            src, done = (k - 1) * mbs + j, done_f
                            t = done[src]
                            if t is None:
                                break
                            r = t + in_f[k]
                    elif code == 2:
                        src, done = k * mbs + j, done_b
                        r = done[src]
                        if r is None:
                            break
                    elif k == last:
                        src, done = k * mbs + j, done_f
                        r = done[src]
                        if r is None:
                            break
                    else:
                        src, done = (k + 1) * mbs + j, done_b
                        t = done[src]
                        if t is None:
                            break
                        r = t + in_b[k]
                    if track and src >= 0 and src in (diff_f if done is done_f else diff_b):
                        reads -= 1
                    start = free[d] if free[d] > r else r
                    took = dur[code][k]
                    free[d] = end = start + took
                    if end > limit_s:
                        return None
                    if track:
                        left[d] -= took
                        if end + left[d] > cut:
                            return None
                    got.append((r, start, end))
                    at += 1
                    moved = True
                    if code == 0:
                        done_f[k * mbs + j] = end
                        live[d] += stash[k]
                        if live[d] > budget[d]:
                            return None
                        if track and end != old_f[k * mbs + j]:
                            diff_f.add(k * mbs + j)
                            reads += 1                  # by F(k + 1), or B(k) on the last
                    else:
                        if code != 2:
                            done_b[k * mbs + j] = end
                            if track and end != old_b[k * mbs + j]:
                                diff_b.add(k * mbs + j)
                                reads += (k > 0) + (code == 1)   # by B(k - 1); by W(k)
                        if code != 1:
                            live[d] -= stash[k]
                    if track:
                        clean = (d != moved_d or at >= same) and end == old_t[d][at - 1][2]
                        if clean == dirty[d]:
                            dirty[d] = not clean
                            n_dirty += -1 if clean else 1
                        if n_dirty == 0 and reads == 0:
                            ptr[d] = at
                            return self._as_before(rows, out, ptr, live, done_f, done_b,
                                                   limit_s, before, sum(ptr) - start_ptr)
                ptr[d] = at
        if any(ptr[d] != len(rows[d]) for d in range(p)):
            return None
        return ReplayState(rows, out, done_f, done_b, timed=sum(ptr) - start_ptr)

    def _as_before(self, rows, out: RowTimes, ptr: list[int], live: list[float], done_f,
                   done_b, limit_s: float, before: _Before, timed: int
                   ) -> ReplayState | None:
        """The rerun's state when every action from `ptr` on runs as it did in
        `before.state`: their old times and ends copied; None where one of them ends
        after `limit_s`, or where the moved rank's stashes, summed in its new order,
        exceed its budget (the other ranks' sums are the old ones, float for float)."""
        old = before.state
        if any(at < len(got) and got[-1][2] > limit_s
               for at, got in zip(ptr, old.times, strict=True)):
            return None
        d, stash, cap = before.rank, self.stash, self.budget[before.rank]
        held = live[d]
        for code, k, _ in rows[d][ptr[d]:]:
            if code == 0:
                held += stash[k]
                if held > cap:
                    return None
            elif code != 1:
                held -= stash[k]
        for got, at, was in zip(out, ptr, old.times, strict=True):
            got += was[at:]
        done_f = [b if a is None else a for a, b in zip(done_f, old.done_f, strict=True)]
        done_b = [b if a is None else a for a, b in zip(done_b, old.done_b, strict=True)]
        return ReplayState(rows, out, done_f, done_b, timed=timed)


class _Before(NamedTuple):
    """What a rerun starts from: the old replay, the rank whose row changed, the
    position on it from which the row is the old one again, and each rank's busy
    seconds still to run."""

    state: ReplayState
    rank: int
    same: int
    left: list[float]


def _start_of(t: tuple[float, float, float]) -> float:
    return t[1]


class RowScore(NamedTuple):
    """How good a replay is, compared as a tuple: makespan first, then the ranks' ends."""

    makespan_s: float              # the last rank's end
    ends_sum_s: float              # every rank's end, summed


def rows_score(times: RowTimes) -> RowScore:
    ends = [end for row_t in times if row_t for _, _, end in row_t[-1:]]
    return RowScore(max(ends), sum(ends))
