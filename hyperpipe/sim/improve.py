"""Local improvement of one pipeline's per-rank action orders (the last step of `synth`).

`replay(c, rows, placement)` times fixed per-rank orders in the list scheduler's model
(`hyperpipe.sim.listsched`: per-stage F, I, W times, fixed link delays, no contention;
B counts as I then W): each action starts when its rank is free and its input is
there. It returns each action's start, end and ready time, or None when the orders
deadlock or a rank's stashes (held from F to W, or to B) exceed its budget.

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

from hyperpipe.plan.schedule import Action, stage_rank
from hyperpipe.sim.listsched import PipeCosts

EPS_S = 1e-12          # why: float sums of the same times in another order differ by ulps
Timing = dict[Action, tuple[float, float, float]]      # action -> (ready, start, end)


def _duration(c: PipeCosts, a: Action) -> float:
    return {"F": c.f_s, "I": c.i_s, "W": c.w_s}[a.op][a.stage] if a.op != "B" \
        else c.i_s[a.stage] + c.w_s[a.stage]


def replay(c: PipeCosts, rows: tuple[tuple[Action, ...], ...],
           placement: str) -> Timing | None:
    """Each action's (ready, start, end) in seconds, or None (deadlock, over budget)."""
    p, n_st = len(rows), len(c.f_s)
    rank_of = [stage_rank(k, p, placement) for k in range(n_st)]
    done_f: dict[tuple[int, int], float] = {}           # (stage, mb) -> F's end
    done_b: dict[tuple[int, int], float] = {}           # (stage, mb) -> I's or B's end
    out: Timing = {}
    ptr, free, live = [0] * p, [0.0] * p, [0.0] * p

    def ready(a: Action) -> float | None:
        k, j = a.stage, a.microbatch
        if a.op == "F":
            if k == 0:
                return 0.0
            t = done_f.get((k - 1, j))
            return None if t is None else t + (
                0.0 if rank_of[k - 1] == rank_of[k] else c.fwd_link_s[k - 1])
        if a.op == "W":
            return done_b.get((k, j))
        if k == n_st - 1:
            return done_f.get((k, j))
        t = done_b.get((k + 1, j))
        return None if t is None else t + (
            0.0 if rank_of[k + 1] == rank_of[k] else c.bwd_link_s[k])

    moved = True
    while moved:
        moved = False
        for d in range(p):
            while ptr[d] < len(rows[d]):
                a = rows[d][ptr[d]]
                r = ready(a)
                if r is None:
                    break
                start = max(free[d], r)
                free[d] = end = start + _duration(c, a)
                out[a] = (r, start, end)
                if a.op == "F":
                    done_f[(a.stage, a.microbatch)] = end
                    live[d] += c.stash_bytes[a.stage]
                    if live[d] > c.budget_bytes[d] * (1 + 1e-9):
                        return None
                else:
                    if a.op in "IB":
                        done_b[(a.stage, a.microbatch)] = end
                    if a.op in "WB":
                        live[d] -= c.stash_bytes[a.stage]
                ptr[d] += 1
                moved = True
    return out if all(ptr[d] == len(rows[d]) for d in range(p)) else None


def _score(rows, timing: Timing) -> tuple[float, float]:
    ends = [timing[row[-1]][2] for row in rows if row]
    return max(ends), sum(ends)


def _conflict(a: Action, b: Action) -> bool:
    """Whether b may not pass a on their rank: the same (stage, micro-batch) (b needs a)
    or the same (stage, op) (each stage runs an op's micro-batches in order)."""
    return a.stage == b.stage and (a.microbatch == b.microbatch or a.op == b.op)


def improve(c: PipeCosts, rows: tuple[tuple[Action, ...], ...], placement: str,
            budget: int = 300) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Better orders (or `rows` itself) and the replays spent (see the module doc)."""
    timing = replay(c, rows, placement)
    if timing is None:
        return rows, 1
    best = tuple(tuple(r) for r in rows)
    score, spent = _score(best, timing), 1
    improved = True
    while improved and spent < budget:
        improved = False
        for d in sorted(range(len(best)), key=lambda d: -timing[best[d][-1]][2]
                        if best[d] else 0.0):
            i = 1
            while i < len(best[d]) and spent < budget:
                row, b = best[d], best[d][i]
                i += 1
                # how far back b can go: over actions that started after it was ready
                j = i - 1
                while j > 0 and not _conflict(row[j - 1], b) and \
                        timing[row[j - 1]][1] > timing[b][0] + EPS_S:
                    j -= 1
                for to in dict.fromkeys((j, i - 2)):      # farthest, then one step
                    if to >= i - 1:
                        continue
                    new_row = row[:to] + (b,) + row[to:i - 1] + row[i:]
                    trial = best[:d] + (new_row,) + best[d + 1:]
                    t = replay(c, trial, placement)
                    spent += 1
                    new = _score(trial, t) if t is not None else None
                    if new is not None and (new[0] < score[0] - EPS_S or (
                            new[0] <= score[0] + EPS_S and new[1] < score[1] - EPS_S)):
                        best, score, timing, improved = trial, new, t, True
                        break
    return best, spent
