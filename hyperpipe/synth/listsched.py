"""List scheduling of one pipeline's actions from per-stage costs: the core of `synth`.

Given per-stage F, I and W times, per-boundary link times, per-stage stash bytes and
each rank's memory budget for stashes, `list_schedule` builds one order per rank by
running the pipeline forward in time: whenever a rank falls idle it picks, among the
actions whose inputs have arrived, by a `Policy`:

1. an I (input-gradient backward: it is on the critical path back to stage 0), oldest
   micro-batch first, deeper stage first;
2. else an F, if the rank's memory budget and its warm-up depth allow it (HAPT's
   heterogeneity-aware 1F1B, arXiv 2509.24859: each rank may run as many forwards ahead
   as its budget lets, not a fixed p - d); later chunks first ("deep") or oldest first;
3. else a W (weight gradient), oldest first: the zero-bubble paper's automatic
   schedule (Qi et al., ICLR'24) puts W's into what would otherwise be bubbles; a W
   also runs when an F waits for memory only W's can free, and before an F when more
   than ``w_limit`` W's are owed (ZB-V's steady state runs each W soon after its I).

With ``f_order="tail"`` the rules give way to a critical-path order (HLFET list
scheduling, Adam et al. 1974): of the actions ready now (the same memory and depth
limits on F's), the one with the longest chain of work behind it, its own time, links
and what waits on it down to stage 0's W, goes first.

With ``patience`` > 0 the rank looks ahead: it waits for an I that arrives within
``patience`` x the duration of the F or W it would start instead; with ``drain_only``
only once it has no forward left (the drain: there the I's chain back to stage 0 is
the tail of the iteration, and a W started just before an I lands delays all of it,
while W's left for the end delay nothing downstream and, no F being left, add no
memory). Each decision is made
at the earliest time any rank could start something, so what is "arrived" is exact for
the model here (fixed link delays, no contention; the SimPy simulator then prices the
result with contention). Pure function; returns None when the policy deadlocks (a memory
budget too small for one micro-batch) so the caller tries another.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hyperpipe.plan.schedule import Action, rank_stages, stage_rank
from hyperpipe.sim.replay import PipeCosts

INF = float("inf")


@dataclass(frozen=True)
class Policy:
    """One way of breaking ties (see the module doc)."""

    depth_extra: int | None = 0      # chunk-0 forwards in flight beyond the base; None: memory only
    w_mode: str = "fill"             # "fill": W's into bubbles; "eager": W right after its I
    f_order: str = "deep"            # "deep": later chunk first; "old": oldest micro-batch
                                     # first; "tail": longest critical chain first (any op)
    patience: float = 0.0            # wait for an I arriving within this x the other action
    w_limit: int | None = None       # W's owed beyond which a W goes before any F
    drain_only: bool = False         # patience only once the rank has no forward left


def base_depth(p: int, v: int, d: int) -> int:
    """Chunk-0 forwards rank d keeps in flight in the fixed kinds: 1F1B's p - d, and for
    v chunks Megatron's warm-up (v - 1) p + 2 (p - 1 - d) + 1 spread over v chunks."""
    if v == 1:
        return p - d
    return max(1, -(-((v - 1) * p + 2 * (p - 1 - d) + 1) // v))


def list_schedule(c: PipeCosts, p: int, m: int, placement: str,
                  policy: Policy) -> tuple[tuple[Action, ...], ...] | None:
    """Per-rank action orders for m micro-batches (None if the policy gets stuck)."""
    n_st = len(c.f_s)
    v = n_st // p
    last = n_st - 1
    homes = [rank_stages(d, p, v, placement) for d in range(p)]
    rank_of = [stage_rank(k, p, placement) for k in range(n_st)]
    f_ready = [[INF] * m for _ in range(n_st)]       # when F(k, j)'s input is there
    i_ready = [[INF] * m for _ in range(n_st)]       # when I(k, j)'s gradient is there
    f_ready[0] = [0.0] * m
    next_f, next_i = [0] * n_st, [0] * n_st
    free = [0.0] * p
    live = [0.0] * p                                  # stash bytes held by rank d
    ahead = [0] * p                                   # chunk-0 forwards not yet through I
    w_queue: list[deque] = [deque() for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    depth = [INF if policy.depth_extra is None else base_depth(p, v, d) + policy.depth_extra
             for d in range(p)]
    reserve = [[sum(c.stash_bytes[s] for s in homes[d] if s > k) for k in range(n_st)]
               for d in range(p)]
    left = 3 * n_st * m
    # critical-path tails: the longest chain of work from an action's start to the end
    # of the iteration (its own time, the links it crosses, all that waits on it)
    tail_i = [0.0] * n_st
    for k in range(n_st):
        hop = 0.0 if k == 0 or rank_of[k - 1] == rank_of[k] else c.bwd_link_s[k - 1]
        tail_i[k] = c.i_s[k] + (c.w_s[0] if k == 0 else hop + tail_i[k - 1])
    tail_f = [0.0] * n_st
    for k in reversed(range(n_st)):
        hop = 0.0 if k == last or rank_of[k + 1] == rank_of[k] else c.fwd_link_s[k]
        tail_f[k] = c.f_s[k] + (tail_i[k] if k == last else hop + tail_f[k + 1])

    def decide(d: int) -> tuple[float, str, int, int]:
        """(start, op, stage, micro-batch) of rank d's next action; start INF: none known."""
        t = free[d]
        best_i = None                                 # (arrival, -stage, stage, mb)
        for k in homes[d]:
            j = next_i[k]
            if j < m and j < next_f[k]:
                key = (max(i_ready[k][j], t), j, -k)
                if best_i is None or key < best_i[0]:
                    best_i = (key, k, j)
        if best_i is not None and best_i[0][0] <= t:
            return t, "I", best_i[1], best_i[2]
        other = None                                  # an F or W to start at t
        cands = []
        for k in homes[d]:
            j = next_f[k]
            if j >= m:
                continue
            chunk0 = k == homes[d][0]
            need = c.stash_bytes[k] + (reserve[d][k] if chunk0 else 0.0)
            if live[d] + need > c.budget_bytes[d] or (chunk0 and ahead[d] >= depth[d]):
                continue
            order = (-k, j) if policy.f_order == "deep" else (j, -k)
            cands.append((max(f_ready[k][j], t), order, k, j))
        cands.sort()
        if policy.f_order == "tail":
            ready = [(-tail_i[k], next_i[k], "I", k) for k in homes[d]
                     if next_i[k] < min(m, next_f[k]) and i_ready[k][next_i[k]] <= t]
            ready += [(-tail_f[k], j, "F", k) for a, _, k, j in cands if a <= t]
            if w_queue[d]:
                k, j = w_queue[d][0]
                ready.append((-c.w_s[k], j, "W", k))
            if ready:
                _, j, op, k = min(ready)
                return t, op, k, j
        if policy.w_limit is not None and len(w_queue[d]) > policy.w_limit:
            k, j = w_queue[d][0]
            return t, "W", k, j
        if cands and cands[0][0] <= t:
            other = (t, "F", cands[0][2], cands[0][3])
        elif w_queue[d]:
            k, j = w_queue[d][0]
            other = (t, "W", k, j)
        if other is not None:
            draining = all(next_f[k] >= m for k in homes[d])
            if best_i is not None and policy.patience > 0 and (draining or not policy.drain_only):
                dur = (c.f_s if other[1] == "F" else c.w_s)[other[2]]
                if best_i[0][0] - t < policy.patience * dur:
                    return best_i[0][0], "I", best_i[1], best_i[2]
            return other
        starts = [best_i[0][0]] if best_i is not None else []
        if cands:
            starts.append(cands[0][0])
        if not starts or min(starts) == INF:
            return INF, "", -1, -1
        if best_i is not None and best_i[0][0] <= (cands[0][0] if cands else INF):
            return best_i[0][0], "I", best_i[1], best_i[2]
        return cands[0][0], "F", cands[0][2], cands[0][3]

    def run(d: int, start: float, op: str, k: int, j: int) -> None:
        nonlocal left
        rows[d].append(Action(k, op, j))
        left -= 1
        if op == "F":
            end = start + c.f_s[k]
            live[d] += c.stash_bytes[k]
            next_f[k] += 1
            if k == homes[d][0]:
                ahead[d] += 1
            if k < last:
                same = rank_of[k + 1] == d
                f_ready[k + 1][j] = end + (0.0 if same else c.fwd_link_s[k])
            else:
                i_ready[k][j] = end
        elif op == "I":
            end = start + c.i_s[k]
            next_i[k] += 1
            if k == homes[d][0]:
                ahead[d] -= 1
            if k > 0:
                same = rank_of[k - 1] == d
                i_ready[k - 1][j] = end + (0.0 if same else c.bwd_link_s[k - 1])
            w_queue[d].append((k, j))
        else:
            end = start + c.w_s[k]
            live[d] -= c.stash_bytes[k]
            w_queue[d].popleft()
        free[d] = end
        if op == "I" and policy.w_mode == "eager":
            run(d, end, "W", k, j)

    # A rank's decision reads only its own state and its stages' arrivals, so after an
    # action only its rank and the rank it sends to decide again (the same choices as
    # asking every rank every time, in p times fewer calls).
    decided: list[tuple[float, str, int, int] | None] = [None] * p
    while left > 0:
        best = None
        for d in range(p):
            if len(rows[d]) == 3 * v * m:
                continue
            if decided[d] is None:
                decided[d] = decide(d)
            choice = decided[d]
            if choice[0] < INF and (best is None or choice[0] < best[1][0]):
                best = (d, choice)
        if best is None:
            return None
        d, (start, op, k, j) = best
        run(d, start, op, k, j)
        decided[d] = None
        if op == "F" and k < last:
            decided[rank_of[k + 1]] = None
        elif op == "I" and k > 0:
            decided[rank_of[k - 1]] = None
    return tuple(tuple(r) for r in rows)
