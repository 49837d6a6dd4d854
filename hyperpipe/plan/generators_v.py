"""V-shaped schedule generators: two chunks per rank placed in a V (rank d holds stages d
and 2p - 1 - d, so the last stage sits on rank 0 next to the first).

Pure functions of (p, m) returning a `Schedule` with ``placement="v"``. Timings quoted
take F = I = W = t (B = 2t) and free links. Both kinds split most backwards into I
(input gradient; the zero-bubble papers' "B") and W (weight gradient) and push the W's
into what would be bubbles.
"""

from __future__ import annotations

from hyperpipe.plan.schedule import Action, Schedule


def _drop_phantoms(rows: list[list[Action]], m: int) -> tuple[tuple[Action, ...], ...]:
    """Drop actions of micro-batches >= m from orders built for more micro-batches.

    A phantom micro-batch's actions depend only on each other, so the remaining order is
    a sub-order of a valid run order and stays deadlock-free (as in `interleaved_1f1b`)."""
    return tuple(tuple(a for a in row if a.microbatch < m) for row in rows)


def zb_v_built(p: int, m: int) -> int:
    """Micro-batches `zb_v` builds for m (phantoms beyond m dropped after)."""
    return max(m, 2 * p - 1)


def dualpipe_v_built(p: int, m: int) -> int:
    """Micro-batches `dualpipe_v` builds for m (phantoms beyond m dropped after)."""
    return max(m, 2 * p)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", sec. 6).

    Rank d, with chunk 0 = stage d and chunk 1 = stage 2p-1-d, runs (n = max(m, 2p - 1)
    micro-batches; phantoms beyond m are dropped at the end):

    1. warm-up: 2(p - d) - 1 forwards of chunk 0; d pairs F1 F0; p - d triples F1 I1 W1
       (the V's bottom, rank p - 1, turns round at once);
    2. steady state: F0 I0 W0 F1 I1 W1 until every forward has run, so a rank holds at
       most 2p micro-batch-chunks of activations - 1F1B's peak on its first rank;
    3. cool-down: d pairs I0 I1, p - d pairs I0 W0, then the deferred W's of chunk 1 and
       of chunk 0, which fill the tail's bubbles.

    With F = I = W = t and m >= 2p - 1 there is no bubble between the warm-up and the
    drain: the makespan is that of torch's ScheduleZBVZeroBubble (tested).
    """
    n = zb_v_built(p, m)
    last = 2 * p - 1
    rows = []
    for d in range(p):
        c0, c1 = d, last - d
        row: list[Action] = []
        nf = {c0: 0, c1: 0}                    # next micro-batch per (stage, op)
        ni = {c0: 0, c1: 0}
        nw = {c0: 0, c1: 0}

        def put(stage: int, op: str, row=row, nf=nf, ni=ni, nw=nw) -> None:
            counter = {"F": nf, "I": ni, "W": nw}[op]
            row.append(Action(stage, op, counter[stage]))
            counter[stage] += 1

        for _ in range(2 * (p - d) - 1):
            put(c0, "F")
        for _ in range(d):
            put(c1, "F")
            put(c0, "F")
        for _ in range(p - d):
            put(c1, "F")
            put(c1, "I")
            put(c1, "W")
        while nf[c1] < nf[c0] or nf[c0] < n:
            if nf[c0] < n:
                put(c0, "F")
            for op in ("I", "W"):
                put(c0, op)
            for op in ("F", "I", "W"):
                put(c1, op)
        for _ in range(d):
            put(c0, "I")
            put(c1, "I")
        for _ in range(p - d):
            put(c0, "I")
            put(c0, "W")
        for stage in (c1, c0):
            while nw[stage] < ni[stage]:
                put(stage, "W")
        rows.append(row)
    return Schedule("zb-v", p, 2 * p, m, _drop_phantoms(rows, m), "v")


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipe-V: DeepSeek-V3's DualPipe (arXiv 2412.19437) folded into a V, as
    torch.distributed.pipelining's ScheduleDualPipeV builds it.

    Rank d (chunk 0 = stage d, chunk 1 = stage 2p-1-d) runs, for n = max(m, 2p)
    micro-batches (torch needs m >= 2p; below that the order for 2p is built and the
    phantoms dropped):

    1. 2(p - d - 1) forwards of chunk 0, then d + 1 pairs F0 F1;
    2. p - d - 1 triples I1, (a queued W), F1;
    3. the main phase, n - 2p + d + 1 rounds of F0 B1 F1 B0: DualPipe overlaps each
       forward with the other chunk's full backward (torch's OVERLAP_F_B); the IR runs
       the pair in order, forward first;
    4. p - d - 1 rounds B1 F1 B0;
    5. d + 1 pairs of backwards of chunk 1 then chunk 0, switching from B to I half way
       (the second half's W's are queued);
    6. p - d - 1 pairs (a queued W), backward of chunk 0; then the queued W's.

    W's run oldest first from one queue shared by both chunks.
    """
    n = dualpipe_v_built(p, m)
    rows = []
    for d in range(p):
        c0, c1 = d, 2 * p - 1 - d
        row: list[Action] = []
        nf = {c0: 0, c1: 0}
        nb = {c0: 0, c1: 0}                    # B and I share a counter (one per mb)
        queue: list[Action] = []               # W's owed, oldest first

        def fwd(stage: int, row=row, nf=nf) -> None:
            row.append(Action(stage, "F", nf[stage]))
            nf[stage] += 1

        def bwd(stage: int, split: bool, row=row, nb=nb, queue=queue) -> None:
            row.append(Action(stage, "I" if split else "B", nb[stage]))
            if split:
                queue.append(Action(stage, "W", nb[stage]))
            nb[stage] += 1

        def weight(row=row, queue=queue) -> None:
            if queue:
                row.append(queue.pop(0))

        for _ in range(2 * (p - d - 1)):
            fwd(c0)
        for _ in range(d + 1):
            fwd(c0)
            fwd(c1)
        for _ in range(p - d - 1):
            bwd(c1, True)
            weight()
            fwd(c1)
        for _ in range(n - 2 * p + d + 1):
            fwd(c0)
            bwd(c1, False)
            fwd(c1)
            bwd(c0, False)
        for _ in range(p - d - 1):
            bwd(c1, False)
            fwd(c1)
            bwd(c0, False)
        split = False
        half = (d + 1) // 2
        for i in range(d + 1):
            split = split or (i == half and d % 2 == 1)
            bwd(c1, split)
            split = split or (i == half and d % 2 == 0)
            bwd(c0, split)
        for _ in range(p - d - 1):
            weight()
            bwd(c0, split)
        for _ in range(d + 1):
            weight()
        rows.append(row)
    return Schedule("dualpipe-v", p, 2 * p, m, _drop_phantoms(rows, m), "v")
