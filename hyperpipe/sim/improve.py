"""Local improvement of one pipeline's per-rank action orders (the last step of `synth`).

`replay(c, rows, placement)` times fixed per-rank orders in the list scheduler's model
(`hyperpipe.sim.listsched`: per-stage F, I, W times, fixed link delays, no contention;
B counts as I then W): each action starts when its rank is free and its input is
there. It returns each action's start, end and ready time, or None when the orders
deadlock or a rank's stashes (held from F to W, or to B) exceed its budget.
`schedule_makespan_s` is that replay's end for a `Schedule`'s own orders, uncapped:
the analytic tier (`hyperpipe.sim.analytic`) prices the V kinds and synth with it.

`improve(c, rows, placement, budget)` hill-climbs on that replay, in the spirit of
list-schedule justification (Valls et al., EJOR 2005): an action that was ready before
its rank started the actions ahead of it moves ahead of them (as far as it was ready,
else one slot), never past an action it depends on or one of its stage's same op;
the move stays when the pipeline's (makespan, sum of rank end times) gets smaller, so
the critical chain shortens first and the ranks' tails next. Ranks that end last are
visited first; passes repeat until no move helps or `budget` replays are spent. The
caller prices the result with the SimPy simulator, which sees contention; nothing here
mutates its input.
"""

from __future__ import annotations

from hyperpipe.plan.schedule import Action, Schedule, stage_rank
from hyperpipe.sim.listsched import PipeCosts

EPS_S = 1e-12          # why: float sums of the same times in another order differ by ulps
Timing = dict[Action, tuple[float, float, float]]      # action -> (ready, start, end)


_CODE = {"F": 0, "I": 1, "W": 2, "B": 3}
RowTimes = list[list[tuple[float, float, float]]]   # [rank][position] -> (ready, start, end)


def replay(c: PipeCosts, rows: tuple[tuple[Action, ...], ...],
           placement: str) -> Timing | None:
    """Each action's (ready, start, end) in seconds, or None (deadlock, over budget)."""
    times = _replay_rows(c, _encode(rows), placement)
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
    times = _replay_rows(costs, _encode(sched.actions), sched.placement)
    if times is None:
        raise ValueError(f"schedule {sched.kind} deadlocks on replay")
    return _score(times)[0]


def _encode(rows) -> list[tuple[tuple[int, int, int], ...]]:
    """Each action as (op code, stage, micro-batch): what `_replay_rows` reads."""
    return [tuple((_CODE[a.op], a.stage, a.microbatch) for a in row) for row in rows]


def _replay_rows(c: PipeCosts, rows, placement: str) -> RowTimes | None:
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
    mbs = 1 + max((a[2] for row in rows for a in row), default=0)
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


def _score(times: RowTimes) -> tuple[float, float]:
    ends = [row_t[-1][2] for row_t in times if row_t]
    return max(ends), sum(ends)


def _conflict(a: Action, b: Action) -> bool:
    """Whether b may not pass a on their rank: the same (stage, micro-batch) (b needs a)
    or the same (stage, op) (each stage runs an op's micro-batches in order)."""
    return a.stage == b.stage and (a.microbatch == b.microbatch or a.op == b.op)


def improve(c: PipeCosts, rows: tuple[tuple[Action, ...], ...], placement: str,
            budget: int = 300) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Better orders (or `rows` itself) and the replays spent (see the module doc)."""
    codes = _encode(rows)
    timing = _replay_rows(c, codes, placement)
    if timing is None:
        return rows, 1
    best = tuple(tuple(r) for r in rows)
    score, spent = _score(timing), 1
    improved = True
    while improved and spent < budget:
        improved = False
        for d in sorted(range(len(best)), key=lambda d: -timing[d][-1][2]
                        if best[d] else 0.0):
            i = 1
            while i < len(best[d]) and spent < budget:
                row, b, times = best[d], best[d][i], timing[d]
                i += 1
                # how far back b can go: over actions that started after it was ready
                j = i - 1
                while j > 0 and not _conflict(row[j - 1], b) and \
                        times[j - 1][1] > times[i - 1][0] + EPS_S:
                    j -= 1
                for to in dict.fromkeys((j, i - 2)):      # farthest, then one step
                    if to >= i - 1:
                        continue
                    new_row = row[:to] + (b,) + row[to:i - 1] + row[i:]
                    code = codes[d]
                    new_code = code[:to] + (code[i - 1],) + code[to:i - 1] + code[i:]
                    trial = best[:d] + (new_row,) + best[d + 1:]
                    trial_codes = codes[:d] + [new_code] + codes[d + 1:]
                    t = _replay_rows(c, trial_codes, placement)
                    spent += 1
                    new = _score(t) if t is not None else None
                    if new is not None and (new[0] < score[0] - EPS_S or (
                            new[0] <= score[0] + EPS_S and new[1] < score[1] - EPS_S)):
                        best, codes, score, timing, improved = \
                            trial, trial_codes, new, t, True
                        break
    return best, spent
