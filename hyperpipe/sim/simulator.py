"""The SimPy simulator: one training iteration of a plan, event by event.

`simulate(plan, cost, options)` returns the iteration's `Metrics` (the same keys as the
analytic tier), a `Trace` of every action, send, all-reduce bucket and optimizer step
(a rank's actions on its tensor-parallel group's first device, timed as on idle links),
and each used device's memory over time. Modelled: one compute stream per pipeline
rank running its schedule row in order; point-to-point sends as flows over the
route's hops, overlapped with compute (or, when the plan's stack sends blocking,
`options.execution_of`, waited out until the message lands, sharing its hops with
whatever crosses them meanwhile), one at a time per stage pair and direction;
data-parallel ring all-reduces per layer range in DDP buckets, overlapped with the last
backward (or after the flush, as the stack says); with tied embeddings the first and
last stage's all-reduce of the embedding's gradient; the engine's per-micro-batch fp32
gradient accumulation where the stack does one (`options.accumulate_extra_s`); the
optimizer step; memory as
static state plus one stash per in-flight micro-batch. Replicas that move alike
(`replicas.replica_classes`) are simulated once, by their first member. Times in
seconds, sizes in bytes. Deterministic: SimPy orders events by (time, priority,
insertion) and nothing here iterates over a set or reads a clock. A schedule that
cannot finish raises `ScheduleError` naming the stuck actions; it never hangs.

Example (a plan file as `hyperpipe search` writes it)::

    >>> from hyperpipe.cluster.cluster import load_cluster
    >>> from hyperpipe.models import load_model
    >>> from hyperpipe.plan.plan import plan_from_dict
    >>> model, cluster = load_model("tiny-gpt"), load_cluster("demo-hetero")
    >>> plan = plan_from_dict({"format": "hyperpipe.plan/1", "model": "tiny-gpt",
    ...     "cluster": "demo-hetero", "global_batch": 16, "schedule": {"kind": "1f1b"},
    ...     "pipelines": [{"micro_batch": 2, "num_microbatches": 8, "stages": [
    ...         {"layers": [0, 5], "devices": ["a100/0"]},
    ...         {"layers": [5, 8], "devices": ["v100/0"]}]}]})
    >>> result = simulate(plan, CostModel(model, cluster))
    >>> result.metrics.iteration_time_s > 0, len(result.trace.devices())
    (True, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from hyperpipe.core.errors import BadInput
from hyperpipe.plan.plan import Plan, schedule_for
from hyperpipe.plan.schedule import Schedule, ScheduleError, validate
from hyperpipe.plan.trace import Trace, TraceEvent
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.experts import expert_state
from hyperpipe.sim.memory import peak_of
from hyperpipe.sim.metrics import Metrics, RankUse, summarize
from hyperpipe.sim.network import Network, p2p_edges
from hyperpipe.sim.options import SimOptions, execution_of
from hyperpipe.sim.program import (
    NEVER,
    Pipe,
    Rank,
    Segment,
    Step,
    Tie,
    prepare_collectives,
    prepare_pipe,
)
from hyperpipe.sim.replicas import replica_classes
from hyperpipe.sim.sharding import dp_shards


@dataclass(frozen=True)
class SimResult:
    metrics: Metrics
    trace: Trace
    memory_timeline: dict[str, list[tuple[float, float]]]   # device -> (time_s, bytes)


_DEFAULTS = SimOptions()      # frozen: one shared default is safe


def simulate(plan: Plan, cost: CostModel, options: SimOptions = _DEFAULTS, *,
             schedule: Schedule | None = None) -> SimResult:
    """Simulate one training iteration of `plan` (times in seconds, sizes in bytes).

    `schedule` replaces the generated one for every pipeline (a user's own order); it is
    validated first and must have each pipeline's ranks, stages and micro-batches.
    """
    if options.check_plan:
        plan.check(cost.model, cost.cluster)
    if schedule is not None and options.validate_schedule:
        validate(schedule)
    return _Engine(plan, cost, options, schedule).run()


class _Engine:
    """One simulation, kept lean (about one SimPy event per action). Each message has a
    box holding its arrival time once known. A send on idle hops costs no event (the
    network returns its arrival time); a rank that needs a message not there yet sleeps,
    and the sender, on learning the arrival time, wakes it at the *end* of its next
    action, with that action's start, so a blocked action also costs one event. If a
    later flow slows the message down, the network says so (`_delayed`) and the reader
    waits for the real delivery instead. Channel queues, bucket chains and flows that
    share hops use callbacks on timeouts, not processes."""

    def __init__(self, plan: Plan, cost: CostModel, options: SimOptions,
                 schedule: Schedule | None):
        self.plan, self.cost, self.opt = plan, cost, options
        self.ex = ex = execution_of(plan, cost)
        self.env = simpy.Environment()
        self.net = Network(self.env, on_delay=self._delayed)
        self.pipes: list[Pipe] = []
        schedules: dict[tuple[int, int], Schedule] = {}
        classes = replica_classes(plan, cost) if options.collapse_replicas else \
            [[q] for q in range(len(plan.pipelines))]
        for members in classes:
            pipe = plan.pipelines[members[0]]
            p, m = len(pipe.stages) // plan.chunks, pipe.num_microbatches
            if schedule is not None:
                got = (schedule.num_devices, schedule.num_stages, schedule.num_microbatches)
                if got != (p, len(pipe.stages), m):
                    raise BadInput("schedule", f"{p} ranks, {len(pipe.stages)} stages and "
                                   f"{m} micro-batches (pipeline {members[0]})", got)
                sched = schedule
            else:
                key = (p, m) if plan.actions is None else members[0]
                sched = schedules.get(key) or schedule_for(plan, members[0])
                schedules[key] = sched
            self.pipes.append(prepare_pipe(plan, cost, ex, Pipe(members[0], members, sched)))
        self.segments = prepare_collectives(plan, cost, options, ex, self.pipes)

    # ------------------------------------------------------------------ processes
    def _rank_process(self, rank: Rank):
        env, pipe, opt = self.env, rank.pipe, self.opt
        eta, waiters, senders = pipe.eta, pipe.waiters, pipe.senders
        busy_until, queues = pipe.busy_until, pipe.queue
        overlap, blocking = self.ex.overlap_dp_allreduce, self.ex.blocking_p2p
        timeline, starts = rank.timeline, rank.starts
        _, current = timeline[0]
        timeout, arrive, delivered = env.timeout, self._arrive, self._delivered
        start_lazy, sent_at, fuse, report_to = self.net.start_lazy, pipe.sent_at, pipe.fuse, \
            self._report
        t1 = env.now
        for i, (dur, wait, box, chan, spec, delta, report, tp, a2a, a2a_beside, ready) in \
                enumerate(rank.program):
            if wait >= 0 and eta[wait] > t1:
                rank.cursor = i
                started = None
                while eta[wait] > env.now:           # not sent yet, or still on its way
                    if eta[wait] == NEVER:
                        # The sender learns the arrival time first; unless this action
                        # must report its start or wait for a gather, it wakes us at
                        # the action's end.
                        fuse[wait] = dur if report < 0 and a2a is None and not ready \
                            else -1.0
                        ev = waiters[wait] = env.event()
                        started = yield ev
                        if started is not None and eta[wait] == started:
                            break                    # ran [started, now] meanwhile
                        started = None
                    else:
                        yield timeout(eta[wait] - env.now)
                t0 = env.now if started is None else started
            else:
                t0, started = t1, None
            if ready > t0:                           # its weights' gather not done yet
                yield timeout(ready - t0)
                t0 = env.now
            if delta > 0:
                current += delta
                timeline.append((t0, current))
            starts.append(t0)
            beside = None
            if a2a_beside:                           # DualPipe: all-to-all beside compute
                beside = [None]
                t = start_lazy(a2a, env.now, _tp_done, beside)
                beside[0] = env.event() if t is None else timeout(t - env.now)
            if started is None:
                if report >= 0:
                    report_to(pipe, report, t0, dur)
                yield timeout(dur)
            if beside is not None:
                yield beside[0]
            elif a2a is not None:                    # expert all-to-alls after compute
                holder = [None]
                t = start_lazy(a2a, env.now, _tp_done, holder)
                holder[0] = env.event() if t is None else timeout(t - env.now)
                yield holder[0]
            if tp is not None:                       # tensor-parallel collectives
                # On idle ports the network returns the delivery time (no flow event);
                # if a flow joins later, `_delayed` moves the wait to `_tp_done`.
                holder = [None]
                t = start_lazy(tp, env.now, _tp_done, holder)
                holder[0] = env.event() if t is None else timeout(t - env.now)
                yield holder[0]
            t1 = env.now
            if delta < 0:
                current += delta
                timeline.append((t1, current))
            if box >= 0:
                if spec is None:
                    arrive(pipe, box, t1)            # same device or free link
                elif busy_until[chan] > t1 or queues[chan]:
                    # the channel's last send still going, or earlier ones queued behind
                    # it (whose pump, due as it lands now, has not run yet): in order
                    self._enqueue(pipe, box, t1)
                else:                                # `_launch`, inlined: the hot path
                    sent_at[box] = t1
                    t = start_lazy(spec, t1, delivered, (pipe, box))
                    if t is None:
                        busy_until[chan] = NEVER
                    else:
                        busy_until[chan] = eta[box] = t
                        if waiters[box] is not None:
                            arrive(pipe, box, t)
                if blocking and spec is not None:
                    # the stream waits until its message lands (behind the channel's
                    # earlier one, sharing the hops with whatever crosses them
                    # meanwhile) before its next action
                    while eta[box] > env.now:
                        if eta[box] == NEVER:        # queued, or slowed by a later flow
                            ev = senders[box] = env.event()
                            yield ev
                        else:                        # rechecked: a flow may join
                            yield timeout(eta[box] - env.now)
                    t1 = env.now
        rank.cursor = len(rank.program)
        rank.busy_s = sum(map(Step.busy_s, rank.program))
        rank.compute_end_s = env.now
        tie = pipe.tie
        ends = [s for s in rank.grad_order if tie is not None and s in tie.stages]
        first = bool(ends) and self.ex.tied_reduce_first
        if first:                            # DeepSpeed: the tie, then the sync
            for _ in ends[1:]:
                self._tie_arrive(tie)
            yield self._tie_arrive(tie)
        if not overlap:
            for s in rank.grad_order:
                self._report(pipe, s, env.now, 0.0)
        for s in rank.grad_order:
            tied = s in ends and not first
            if not (opt.include_optimizer or tied):
                continue
            if pipe.pending.get(s, 0) > 0:
                ev = pipe.reduce_wait[s] = env.event()
                yield ev
            if tied:
                yield self._tie_arrive(tie)
            if opt.include_optimizer:
                st = self.plan.pipelines[pipe.index].stages[s]
                share, shards = expert_state(self.cost, self.plan, st)
                dt = self.cost.optimizer_time_s(
                    st.layers, self.cost.cluster.device(st.devices[0]).type.name, st.tp,
                    dp_shards(self.plan, st, self.cost.cluster), st.devices, expert_share=share,
                    expert_shards=shards)
                if dt > 0:
                    t0 = env.now
                    yield timeout(dt)
                    rank.opt_log.append((s, t0, env.now))
        rank.end_s = env.now

    # ------------------------------------------------------------------ transfers
    # A box (one per message) holds its arrival time `eta`: NEVER until it is known.
    # Channel c (one stage pair, one direction) sends one message at a time; `busy_until`
    # is when its current one lands (NEVER while that is not known yet).
    def _arrive(self, pipe: Pipe, box: int, t: float) -> None:
        """Message `box` lands at time t (now or later): wake its reader then; a blocking
        sender waiting for it wakes now and sleeps until t itself."""
        pipe.eta[box] = t
        sender = pipe.senders[box]
        if sender is not None:
            pipe.senders[box] = None
            sender.succeed()
        ev = pipe.waiters[box]
        if ev is not None:
            pipe.waiters[box] = None
            now = self.env.now
            run_s = pipe.fuse[box]
            if run_s >= 0:
                # The reader is idle and its action starts at t: wake it at the action's
                # end, with t as the start (it checks t still holds). Its resume callback
                # moves with `callbacks`; `_delayed` moves it back if t stops holding.
                later = self.env.timeout(t - now + run_s, t)
                later.callbacks, ev.callbacks = ev.callbacks, []
                pipe.wake[box] = later
            elif t <= now:
                ev.succeed()
            else:
                later = self.env.timeout(t - now)
                later.callbacks, ev.callbacks = ev.callbacks, []
                pipe.wake[box] = later

    def _enqueue(self, pipe: Pipe, box: int, now: float) -> None:
        channel = box // pipe.m
        queue = pipe.queue[channel]
        queue.append(box)
        if len(queue) == 1 and pipe.busy_until[channel] < NEVER:
            self._pump_at(pipe, channel, now)

    def _launch(self, pipe: Pipe, channel: int, box: int, now: float, spec) -> None:
        pipe.sent_at[box] = now
        t = self.net.start_lazy(spec, now, self._delivered, (pipe, box))
        if t is None:
            pipe.busy_until[channel] = NEVER       # shared hops: `_delivered` will tell
            return
        pipe.busy_until[channel] = t
        pipe.eta[box] = t
        if pipe.waiters[box] is not None or pipe.senders[box] is not None:
            self._arrive(pipe, box, t)

    def _pump_at(self, pipe: Pipe, channel: int, now: float) -> None:
        """Pump the channel when its current message lands, unless that time changes."""
        landing = pipe.busy_until[channel]
        self.env.timeout(landing - now).callbacks.append(
            lambda _e: pipe.busy_until[channel] == landing and self._pump(pipe, channel))

    def _pump(self, pipe: Pipe, channel: int) -> None:
        """Start the channel's next queued message (its current one has landed)."""
        now = self.env.now
        queue = pipe.queue[channel]
        if not queue:
            return
        self._launch(pipe, channel, queue.popleft(), now, pipe.channel_spec[channel])
        if queue and pipe.busy_until[channel] < NEVER:
            self._pump_at(pipe, channel, now)

    def _delivered(self, token) -> None:
        """Network callback: a message whose time was not known in advance landed."""
        pipe, box = token
        now = self.env.now
        self._arrive(pipe, box, now)
        # A channel sends one message at a time, so this one is its current one.
        channel = box // pipe.m
        pipe.busy_until[channel] = now
        self._pump(pipe, channel)

    def _delayed(self, token) -> None:
        """Network callback: another flow joined this message's hops; time unknown."""
        if type(token) is list:
            # A tensor-parallel flow: its rank sleeps on a timeout that no longer holds;
            # make it wait for the delivery (`_tp_done`) instead.
            later = token[0]
            ev = self.env.event()
            ev.callbacks, later.callbacks = later.callbacks, []
            token[0] = ev
            return
        pipe, box = token
        pipe.eta[box] = NEVER
        later = pipe.wake[box]
        if later is not None and later.callbacks:
            # The reader sleeps until a time that no longer holds: make it wait for the
            # delivery instead (the stale timeout fires with nobody listening).
            ev = pipe.waiters[box] = self.env.event()
            ev.callbacks, later.callbacks = later.callbacks, []
        pipe.wake[box] = None
        pipe.busy_until[box // pipe.m] = NEVER

    def _tie_arrive(self, tie: Tie) -> simpy.Event:
        """A rank holding one end of a tied embedding has its gradients reduced: the
        all-reduce starts once both ends are there; the event fires when it is done."""
        if tie.event is None:
            tie.event = self.env.event()
        tie.arrived += 1
        if tie.arrived == 2:
            tie.start_s = self.env.now
            spec = tie.spec
            self.net.start(spec.hops, spec.work_s, spec.latency_s, self._tie_done, tie)
        return tie.event

    def _tie_done(self, tie: Tie) -> None:
        tie.done_s = self.env.now
        tie.event.succeed()

    def _report(self, pipe: Pipe, stage: int, start_s: float, dur_s: float) -> None:
        for seg in pipe.segments.get(stage, ()):
            seg.reports.append((start_s, dur_s))
            if len(seg.reports) == len(seg.parts):
                self._bucket(seg, 0)

    def _bucket(self, seg: Segment, j: int) -> None:
        env = self.env
        if j == seg.k:
            seg.done_s = env.now
            for pipe, s in seg.parts:
                pipe.pending[s] -= 1
                if pipe.pending[s] == 0 and s in pipe.reduce_wait:
                    pipe.reduce_wait[s].succeed()
            return
        ready = max(t + (j + 1) / seg.k * d for t, d in seg.reports)
        if ready > env.now:
            env.timeout(ready - env.now).callbacks.append(lambda _e: self._bucket(seg, j))
            return
        spec = seg.full if j < seg.k - 1 else seg.last
        self.net.start(spec.hops, spec.work_s, spec.latency_s, self._bucket_done,
                       (seg, j, env.now))

    def _bucket_done(self, token) -> None:
        seg, j, t0 = token
        seg.log.append((j, t0, self.env.now))
        self._bucket(seg, j + 1)

    # ------------------------------------------------------------------ run and results
    def run(self) -> SimResult:
        for pipe in self.pipes:
            for rank in pipe.ranks:
                self.env.process(self._rank_process(rank))
        self.env.run()
        self._check_finished()
        return self._result()

    def _result(self) -> SimResult:
        plan, cost = self.plan, self.cost
        cluster = cost.cluster
        iteration = max([r.end_s for p in self.pipes for r in p.ranks]
                        + [seg.done_s for seg in self.segments]
                        + [p.tie.done_s for p in self.pipes if p.tie is not None])
        timelines: dict[str, list[tuple[float, float]]] = {}
        uses: list[RankUse] = []
        for pipe in self.pipes:
            for r in pipe.ranks:
                devices = tuple(dev for q in pipe.members
                                for dev in plan.pipelines[q].stages[r.d].devices)
                for dev in devices:
                    timelines[dev] = r.timeline
                uses.append(RankUse(devices, cluster.device(r.devices[0]).type,
                                    tuple(sorted(set(r.stages))), peak_of(r.timeline),
                                    r.busy_s))
        ranks = [r for pipe in self.pipes for r in pipe.ranks]
        top = max(ranks, key=lambda r: r.busy_s)
        extra = {
            "tier": "simulated",
            "bottleneck": {"pipeline": top.pipe.index, "rank": top.d, "device": top.devices[0],
                           "device_type": cluster.device(top.devices[0]).type.name,
                           "stages": sorted(set(top.stages)), "busy_s": top.busy_s},
            "phases": {
                "pipeline_s": max(r.compute_end_s for r in ranks),
                "dp_allreduce_end_s": max((seg.done_s for seg in self.segments), default=0.0),
                # the first and last stage's all-reduce of a tied embedding's gradient
                "tied_allreduce_end_s": max((p.tie.done_s for p in self.pipes
                                             if p.tie is not None), default=0.0),
                "optimizer_s": max(sum(b - a for _, a, b in r.opt_log) for r in ranks),
                "iteration_s": iteration},
            "ranks": [{"pipeline": r.pipe.index, "rank": r.d, "device": r.devices[0],
                       "busy_s": r.busy_s, "compute_end_s": r.compute_end_s,
                       "end_s": r.end_s} for r in ranks],
            "replica_classes": [pipe.members for pipe in self.pipes],
            "simulated_actions": sum(len(r.ops) for r in ranks),
        }
        metrics = summarize(plan, cost, iteration, uses, extra)
        return SimResult(metrics, self._trace(), timelines)

    def _trace(self) -> Trace:
        plan = self.plan
        meta = {"source": "simulated", "emulated": False, "plan": plan.to_dict(),
                "device_types": {}, "represents": {}}
        if not self.opt.trace:
            return Trace((), meta)
        events: list[TraceEvent] = []
        for pipe in self.pipes:
            meta["represents"][str(pipe.index)] = pipe.members
            stages, m = plan.pipelines[pipe.index].stages, pipe.m
            n_st = len(stages)
            nbytes = [spec.nbytes * len(p2p_edges(stages[k].devices, stages[k + 1].devices))
                      if spec else 0.0 for k, spec in enumerate(pipe.fwd)]
            sent: dict[int, list[TraceEvent]] = {}
            for box, t0 in enumerate(pipe.sent_at):
                if t0 is None:
                    continue
                t1 = pipe.eta[box]
                fwd = box < n_st * m
                k, j = divmod(box if fwd else box - n_st * m, m)
                src, dst = (k, k + 1) if fwd else (k + 1, k)
                rank = src % len(pipe.ranks)
                sent.setdefault(rank, []).append(TraceEvent(
                    stages[src].devices[0], "send", src, j, t0, t1, nbytes[k],
                    stages[dst].devices[0]))
            for r in pipe.ranks:
                dev = r.devices[0]
                meta["device_types"][dev] = self.cost.cluster.device(dev).type.name
                ops, stg, mbs = r.ops, r.stages, r.mbs
                events.extend(TraceEvent(dev, ops[i], stg[i], mbs[i], t0, t0 + step.busy_s())
                              for i, (t0, step) in enumerate(zip(r.starts, r.program,
                                                                 strict=False)))
                events.extend(sent.get(r.d, ()))
                events.extend(TraceEvent(dev, "optimizer", s, 0, t0, t1)
                              for s, t0, t1 in r.opt_log)
        # the step's data-parallel sync as the executor names it: ZeRO-2's is the
        # updated weights' all-gather, ZeRO-3's (gathering once per step) the gradients'
        # reduce-scatter (`CostModel.dp_sync_bytes_per_param`)
        sync = {2: "allgather", 3: "reducescatter"}.get(self.ex.zero, "allreduce")
        for seg in self.segments:
            for pipe, s in seg.parts:
                dev = plan.pipelines[pipe.index].stages[s].devices[0]
                events.extend(TraceEvent(dev, sync, s, j, t0, t1,
                                         seg.full.nbytes if j < seg.k - 1 else seg.last.nbytes)
                              for j, t0, t1 in seg.log)
        for pipe in self.pipes:               # tied embeddings: micro-batch -1
            tie = pipe.tie
            if tie is not None and tie.arrived == 2:
                a, b = tie.peers
                events += [TraceEvent(a, "allreduce", tie.stages[0], -1, tie.start_s,
                                      tie.done_s, tie.spec.nbytes, b),
                           TraceEvent(b, "allreduce", tie.stages[1], -1, tie.start_s,
                                      tie.done_s, tie.spec.nbytes, a)]
        return Trace(tuple(events), meta)

    def _check_finished(self) -> None:
        stuck = []
        for pipe in self.pipes:
            for r in pipe.ranks:
                if r.cursor < len(r.ops):
                    i = r.cursor
                    s, op, j = r.stages[i], r.ops[i], r.mbs[i]
                    if op == "F":
                        waits = f"{s - 1}F{j}"
                    else:
                        later = {a.op for a in pipe.schedule.actions[(s + 1) % len(
                            pipe.ranks)] if a.stage == s + 1 and a.microbatch == j}
                        waits = f"{s + 1}{'I' if 'I' in later else 'B'}{j}"
                    stuck.append(f"pipeline {pipe.index} rank {r.d} step {i} {s}{op}{j} "
                                 f"waits for {waits}")
        if stuck:
            raise ScheduleError("simulate", "every rank to finish its actions (deadlock)",
                                got_text="; ".join(stuck))


def _tp_done(holder: list) -> None:
    """Network callback: a tensor-parallel flow that shared its ports is delivered."""
    holder[0].succeed()


__all__ = ["SimOptions", "SimResult", "simulate"]
