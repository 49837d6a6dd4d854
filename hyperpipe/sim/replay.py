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
    p, n_st = len(rows), len(c.f_s)
    rank_of = [stage_rank(k, p, placement) for k in range(n_st)]
    # what an input takes to arrive from the neighbouring stage (0 on the same rank)
    in_f = [0.0] + [0.0 if rank_of[k - 1] == rank_of[k] else c.fwd_link_s[k - 1]
                    for k in range(1, n_st)]
    in_b = [0.0 if rank_of[k + 1] == rank_of[k] else c.bwd_link_s[k]
            for k in range(n_st - 1)] + [0.0]
    dur = (c.f_s, c.i_s, c.w_s,
           c.b_s or [i + w for i, w in zip(c.i_s, c.w_s, strict=True)])
    stash, budget = c.stash_bytes, [b * (1 + 1e-9) for b in c.budget_bytes]
    mbs = 1 + max((j for row in rows for _, _, j in row), default=0)
    done_f: list[float | None] = [None] * (n_st * mbs)    # F's end per (stage, mb)
    done_b: list[float | None] = [None] * (n_st * mbs)    # I's or B's end
    last = n_st - 1
    out: RowTimes = [[] for _ in range(p)]
    ptr, free, live = [0] * p, [0.0] * p, [0.0] * p
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
    return out if all(ptr[d] == len(rows[d]) for d in range(p)) else None


class RowScore(NamedTuple):
    """How good a replay is, compared as a tuple: makespan first, then the ranks' ends."""

    makespan_s: float              # the last rank's end
    ends_sum_s: float              # every rank's end, summed


def rows_score(times: RowTimes) -> RowScore:
    ends = [end for row_t in times if row_t for _, _, end in row_t[-1:]]
    return RowScore(max(ends), sum(ends))
