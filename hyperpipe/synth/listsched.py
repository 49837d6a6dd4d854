"""List scheduling of one pipeline's actions from per-stage costs: the core of `synth`.

`list_schedule(c, p, m, placement, policy)` takes per-stage F, I and W seconds,
per-boundary link seconds, per-stage stash bytes and each rank's stash budget, and
builds one order per rank by running the pipeline forward in time: whenever a rank is
idle it picks, among the actions whose inputs have arrived, by its `Policy`: an I first
(oldest micro-batch, deeper stage); else an F within the rank's memory budget and
warm-up depth (HAPT's heterogeneity-aware 1F1B, arXiv 2509.24859); else a W (the
zero-bubble paper's automatic schedule, Qi et al., ICLR'24). ``f_order="tail"`` takes
the ready action with the longest critical chain behind it (HLFET, Adam et al. 1974);
``patience`` waits for an I arriving soon, ``drain_only`` only once no F is left.
Decisions are made at the earliest time any rank could start something, so arrivals
are exact for this model (fixed link delays, no contention; the simulator then prices
the result with contention). Pure; None when the policy deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

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


class Choice(NamedTuple):
    """A rank's next action: start it at `start_s` (INF: nothing known to start)."""

    start_s: float
    op: str           # "F", "I" or "W" ("" when nothing is known)
    stage: int
    mb: int


NOTHING = Choice(INF, "", -1, -1)


class NextI(NamedTuple):
    """A rank's most urgent I: compared as a tuple, the earliest arrival first, then the
    oldest micro-batch, then the deeper stage."""

    arrival_s: float
    mb: int
    neg_stage: int

    @property
    def stage(self) -> int:
        return -self.neg_stage


class NextF(NamedTuple):
    """A forward a rank may start (within its memory and depth limits): compared as a
    tuple, the earliest ready first, then by the policy's `f_order`."""

    ready_s: float
    order: tuple[int, int]
    stage: int
    mb: int


@dataclass(slots=True)
class ListState:
    """Everything the list scheduler tracks for one pipeline, times in seconds, memory
    in bytes; `[k]` indexes stages, `[d]` ranks, `[k][j]` a stage's micro-batches."""

    c: PipeCosts
    policy: Policy
    m: int
    v: int
    homes: list[list[int]]               # [d]: the stages on rank d, chunk 0 first
    rank_of: list[int]                   # [k]: the rank holding stage k
    f_ready: list[list[float]]           # [k][j]: when F(k, j)'s input is there
    i_ready: list[list[float]]           # [k][j]: when I(k, j)'s gradient is there
    next_f: list[int]                    # [k]: the next micro-batch to go forward
    next_i: list[int]                    # [k]: the next micro-batch to go backward
    free_s: list[float]                  # [d]: when rank d is next idle
    live_bytes: list[float]              # [d]: stash bytes held by rank d
    ahead: list[int]                     # [d]: chunk-0 forwards not yet through I
    w_queue: list[deque]                 # [d]: (stage, mb) of the W's owed, oldest first
    rows: list[list[Action]]             # [d]: the order built so far
    depth: list[float]                   # [d]: chunk-0 forwards allowed in flight
    reserve_bytes: list[list[float]]     # [d][k]: stashes of rank d's stages after k
    tail_i_s: list[float]                # [k]: critical chain from I(k)'s start
    tail_f_s: list[float]                # [k]: critical chain from F(k)'s start
    left: int                            # actions not yet placed

    @property
    def last(self) -> int:
        return len(self.rank_of) - 1


def list_schedule(c: PipeCosts, p: int, m: int, placement: str,
                  policy: Policy) -> tuple[tuple[Action, ...], ...] | None:
    """Per-rank action orders for m micro-batches (None if the policy gets stuck)."""
    s = _initial_state(c, p, m, placement, policy)
    # A rank's decision reads only its own state and its stages' arrivals, so after an
    # action only its rank and the rank it sends to decide again (the same choices as
    # asking every rank every time, in p times fewer calls).
    # The rank that starts first runs (the lowest rank on a tie); `starts` holds each
    # rank's decided start (INF once its row is full), so the pick is one `min`.
    decided: list[Choice] = [_decide(s, d) for d in range(p)]
    starts = [choice.start_s for choice in decided]
    per_rank = 3 * s.v * m
    rows, rank_of, last = s.rows, s.rank_of, s.last
    while s.left > 0:
        best_s = min(starts)
        if best_s == INF:
            return None
        best_d = starts.index(best_s)
        best = decided[best_d]
        _run(s, best_d, best)
        stale = [best_d]
        if best.op == "F" and best.stage < last:
            stale.append(rank_of[best.stage + 1])
        elif best.op == "I" and best.stage > 0:
            stale.append(rank_of[best.stage - 1])
        for d in stale:
            if len(rows[d]) == per_rank:
                starts[d] = INF
            else:
                decided[d] = _decide(s, d)
                starts[d] = decided[d].start_s
    return tuple(tuple(r) for r in s.rows)


def _initial_state(c: PipeCosts, p: int, m: int, placement: str,
                   policy: Policy) -> ListState:
    """Nothing run yet: stage 0's inputs all there at time 0."""
    n_st = len(c.f_s)
    v = n_st // p
    homes = [rank_stages(d, p, v, placement) for d in range(p)]
    rank_of = [stage_rank(k, p, placement) for k in range(n_st)]
    f_ready = [[INF] * m for _ in range(n_st)]
    f_ready[0] = [0.0] * m
    depth = [INF if policy.depth_extra is None else base_depth(p, v, d) + policy.depth_extra
             for d in range(p)]
    reserve = [[sum(c.stash_bytes[s] for s in homes[d] if s > k) for k in range(n_st)]
               for d in range(p)]
    tail_i, tail_f = _critical_tails(c, rank_of)
    return ListState(c=c, policy=policy, m=m, v=v, homes=homes, rank_of=rank_of,
                     f_ready=f_ready, i_ready=[[INF] * m for _ in range(n_st)],
                     next_f=[0] * n_st, next_i=[0] * n_st, free_s=[0.0] * p,
                     live_bytes=[0.0] * p, ahead=[0] * p,
                     w_queue=[deque() for _ in range(p)], rows=[[] for _ in range(p)],
                     depth=depth, reserve_bytes=reserve, tail_i_s=tail_i, tail_f_s=tail_f,
                     left=3 * n_st * m)


def _critical_tails(c: PipeCosts, rank_of: list[int]) -> tuple[list[float], list[float]]:
    """Per stage, the longest chain of work from an I's and from an F's start to the end
    of the iteration (its own time, the links it crosses, all that waits on it)."""
    n_st = len(rank_of)
    last = n_st - 1
    tail_i = [0.0] * n_st
    for k in range(n_st):
        hop = 0.0 if k == 0 or rank_of[k - 1] == rank_of[k] else c.bwd_link_s[k - 1]
        tail_i[k] = c.i_s[k] + (c.w_s[0] if k == 0 else hop + tail_i[k - 1])
    tail_f = [0.0] * n_st
    for k in reversed(range(n_st)):
        hop = 0.0 if k == last or rank_of[k + 1] == rank_of[k] else c.fwd_link_s[k]
        tail_f[k] = c.f_s[k] + (tail_i[k] if k == last else hop + tail_f[k + 1])
    return tail_i, tail_f


def _next_i(s: ListState, d: int, t: float) -> NextI | None:
    """Rank d's most urgent I among those whose F has run (None: none)."""
    best = None
    next_i, next_f, i_ready, m = s.next_i, s.next_f, s.i_ready, s.m
    for k in s.homes[d]:
        j = next_i[k]
        if j < m and j < next_f[k]:
            key = (max(i_ready[k][j], t), j, -k)
            if best is None or key < best:
                best = key
    return None if best is None else NextI(*best)


def _forwards(s: ListState, d: int, t: float) -> list[NextF]:
    """The forwards rank d's memory budget and warm-up depth allow, best first."""
    homes, stash, next_f, m = s.homes[d], s.c.stash_bytes, s.next_f, s.m
    live, budget = s.live_bytes[d], s.c.budget_bytes[d]
    deep = s.policy.f_order == "deep"
    cands = []
    for k in homes:
        j = next_f[k]
        if j >= m:
            continue
        if k == homes[0]:
            if live + (stash[k] + s.reserve_bytes[d][k]) > budget or s.ahead[d] >= s.depth[d]:
                continue
        elif live + stash[k] > budget:
            continue
        cands.append(NextF(max(s.f_ready[k][j], t), (-k, j) if deep else (j, -k), k, j))
    if len(cands) > 1:
        cands.sort()
    return cands


def _critical_choice(s: ListState, d: int, t: float, cands: list[NextF]) -> Choice | None:
    """`f_order="tail"`: of the actions ready at t, the one with the longest chain
    behind it (None: nothing ready)."""
    homes, m = s.homes[d], s.m
    ready = [(-s.tail_i_s[k], s.next_i[k], "I", k) for k in homes
             if s.next_i[k] < min(m, s.next_f[k]) and s.i_ready[k][s.next_i[k]] <= t]
    ready += [(-s.tail_f_s[f.stage], f.mb, "F", f.stage) for f in cands if f.ready_s <= t]
    if s.w_queue[d]:
        k, j = s.w_queue[d][0]
        ready.append((-s.c.w_s[k], j, "W", k))
    if not ready:
        return None
    _, j, op, k = min(ready)
    return Choice(t, op, k, j)


def _decide(s: ListState, d: int) -> Choice:
    """Rank d's next action by the policy (the module doc's rules)."""
    policy, t = s.policy, s.free_s[d]
    best_i = _next_i(s, d, t)
    if best_i is not None and best_i.arrival_s <= t:
        return Choice(t, "I", best_i.stage, best_i.mb)
    cands = _forwards(s, d, t)
    if policy.f_order == "tail":
        critical = _critical_choice(s, d, t, cands)
        if critical is not None:
            return critical
    if policy.w_limit is not None and len(s.w_queue[d]) > policy.w_limit:
        k, j = s.w_queue[d][0]
        return Choice(t, "W", k, j)
    other = None                                  # an F or W to start at t
    if cands and cands[0].ready_s <= t:
        other = Choice(t, "F", cands[0].stage, cands[0].mb)
    elif s.w_queue[d]:
        k, j = s.w_queue[d][0]
        other = Choice(t, "W", k, j)
    if other is not None:
        return _wait_for_i(s, d, t, best_i, other)
    return _earliest(best_i, cands)


def _wait_for_i(s: ListState, d: int, t: float, best_i: NextI | None,
                other: Choice) -> Choice:
    """`other` (an F or W at t), or the I arriving within `patience` x its duration."""
    policy = s.policy
    if best_i is None or policy.patience <= 0:
        return other
    draining = all(s.next_f[k] >= s.m for k in s.homes[d])
    if not (draining or not policy.drain_only):
        return other
    dur = (s.c.f_s if other.op == "F" else s.c.w_s)[other.stage]
    if best_i.arrival_s - t < policy.patience * dur:
        return Choice(best_i.arrival_s, "I", best_i.stage, best_i.mb)
    return other


def _earliest(best_i: NextI | None, cands: list[NextF]) -> Choice:
    """Nothing to start now: the earliest I or F to come (NOTHING: none known)."""
    starts = [best_i.arrival_s] if best_i is not None else []
    if cands:
        starts.append(cands[0].ready_s)
    if not starts or min(starts) == INF:
        return NOTHING
    if best_i is not None and best_i.arrival_s <= (cands[0].ready_s if cands else INF):
        return Choice(best_i.arrival_s, "I", best_i.stage, best_i.mb)
    return Choice(cands[0].ready_s, "F", cands[0].stage, cands[0].mb)


def _run(s: ListState, d: int, choice: Choice) -> None:
    """Place `choice` on rank d and update arrivals, memory and counters (with
    ``w_mode="eager"`` an I's W follows it at once)."""
    start, op, k, j = choice
    c = s.c
    s.rows[d].append(Action(k, op, j))
    s.left -= 1
    if op == "F":
        end = start + c.f_s[k]
        s.live_bytes[d] += c.stash_bytes[k]
        s.next_f[k] += 1
        if k == s.homes[d][0]:
            s.ahead[d] += 1
        if k < s.last:
            same = s.rank_of[k + 1] == d
            s.f_ready[k + 1][j] = end + (0.0 if same else c.fwd_link_s[k])
        else:
            s.i_ready[k][j] = end
    elif op == "I":
        end = start + c.i_s[k]
        s.next_i[k] += 1
        if k == s.homes[d][0]:
            s.ahead[d] -= 1
        if k > 0:
            same = s.rank_of[k - 1] == d
            s.i_ready[k - 1][j] = end + (0.0 if same else c.bwd_link_s[k - 1])
        s.w_queue[d].append((k, j))
    else:
        end = start + c.w_s[k]
        s.live_bytes[d] -= c.stash_bytes[k]
        s.w_queue[d].popleft()
    s.free_s[d] = end
    if op == "I" and s.policy.w_mode == "eager":
        _run(s, d, Choice(end, "W", k, j))
