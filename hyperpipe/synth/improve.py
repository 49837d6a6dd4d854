"""Local improvement of one pipeline's per-rank action orders (the last step of `synth`).

`improve(c, rows, placement, budget)` hill-climbs on `hyperpipe.sim.replay`'s timing of
fixed per-rank orders (per-stage F, I, W seconds, fixed link delays, no contention), in
the spirit of list-schedule justification (Valls et al., EJOR 2005): an action that was
ready before its rank started the actions ahead of it moves ahead of them (as far as it
was ready, else one slot), never past an action it depends on or one of its stage's
same op; a move stays when the pipeline's (makespan, sum of rank end times) gets
smaller. Ranks that end last are visited first; passes repeat until no move helps or
`budget` replays are spent. The caller prices the result with the SimPy simulator,
which sees contention; nothing here mutates its input.
"""

from __future__ import annotations

from hyperpipe.plan.schedule import Action
from hyperpipe.sim.replay import EPS_S, PipeCosts, Replayer, encode_rows, rows_score


def _conflict(a: Action, b: Action) -> bool:
    """Whether b may not pass a on their rank: the same (stage, micro-batch) (b needs a)
    or the same (stage, op) (each stage runs an op's micro-batches in order)."""
    return a.stage == b.stage and (a.microbatch == b.microbatch or a.op == b.op)


def improve(c: PipeCosts, rows: tuple[tuple[Action, ...], ...], placement: str,
            budget: int = 300) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Better orders (or `rows` itself) and the replays spent (see the module doc)."""
    codes = encode_rows(rows)
    replayer = Replayer(c, len(rows), placement, codes)
    state = replayer.run(codes)
    if state is None:
        return rows, 1
    timing = state.times
    best = tuple(tuple(r) for r in rows)
    score, spent = rows_score(timing), 1
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
                    # re-timed from the moved action's old slot on (`Replayer.rerun`),
                    # given up once it is sure to end past the makespan (it cannot stay)
                    got = replayer.rerun(state, trial_codes, d, to, score[0] + EPS_S)
                    spent += 1
                    new = rows_score(got.times) if got is not None else None
                    if new is not None and (new[0] < score[0] - EPS_S or (
                            new[0] <= score[0] + EPS_S and new[1] < score[1] - EPS_S)):
                        best, codes, score, state, improved = \
                            trial, trial_codes, new, got, True
                        timing = state.times
                        break
    return best, spent
