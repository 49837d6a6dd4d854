"""Expert parallelism in the executor: the routed experts of a stage's MoE blocks spread
over the `ep` ranks of an expert-parallel group, tokens dispatched to their expert's
owner and the outputs combined back with all-to-alls.

Groups (the plan's rule, `hyperpipe.plan.plan.StagePlan.ep`, after Megatron-Core's
"tp-cp-ep-dp-pp" order): the ranks holding a stage's layers in every data-parallel
replica, in pipeline order, cut into runs of `ep`; rank i of a group holds experts
[i·E/ep, (i+1)·E/ep) of each MoE block of the stage. Router, attention, norms and shared
experts stay replicated and are reduced over the usual data-parallel group; an expert's
parameters over its expert-data-parallel group, the ranks holding that expert in every
expert-parallel group of the layer (`reduction_groups`).

One MoE block's routed experts on one rank (`Dispatcher`), per micro-batch: its own
tokens are routed and capacity-dropped locally (models.gpt.MoE; as Megatron-LM does,
NVIDIA/Megatron-LM megatron/core/transformer/moe/moe_utils.py
`apply_router_token_dropping`, capacity from the rank's own tokens), the per-expert
counts are exchanged (an all-to-all of E integers), the rows go to their owner
(dispatch: `dist.all_to_all_single` over the group, uneven splits), each local expert
runs on the rows every source sent it, and the outputs return the same way (combine);
gates multiply on the source rank. Both all-to-alls are autograd functions whose
backward is the reverse all-to-all, so B (or I) runs the transposed pair.

Every rank of a group must run the same sequence of all-to-alls: the placement check
(`exec.runnable.check_expert_parallel`) asks that they replay the same actions of their
expert-parallel stages. Without link emulation each all-to-all is traced as it ran (op ``alltoall``,
inside its compute action); with emulation (exec.links) its gloo time is hidden in the
action's stretched compute and its link time is replayed after the compute as one flow
per peer of the real bytes (`emulate_alltoall`), traced as ``alltoall`` events. For
timing the compute alone before a run (exec.reference, one rank at a time) the
dispatcher runs `solo`: no peer, as if every peer routed to this rank's experts what this
rank routes to them (the expected load under even routing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hyperpipe.exec.comm import wait
from hyperpipe.exec.links import Links
from hyperpipe.exec.placement import ExpertGroup, expert_groups, placements
from hyperpipe.models.gpt import MoE, run_experts
from hyperpipe.models.spec import ModelSpec, is_moe_layer
from hyperpipe.plan.plan import Plan
from hyperpipe.plan.trace import TraceEvent

DENSE = -1      # reduction key part of a layer's non-expert parameters: (layer, DENSE)


def local_experts(experts: int, ep: int, index: int) -> range:
    """The experts rank `index` of an expert-parallel group of `ep` holds."""
    per = experts // ep
    return range(index * per, (index + 1) * per)


def reduction_groups(plan: Plan, spec: ModelSpec
                     ) -> list[tuple[tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """Gradient reduction groups with expert parallelism: (ranks, keys) for every set of
    two or more ranks that hold the same parameters, a key being (layer, DENSE) for a
    layer's replicated parameters (all of them where ep = 1) and (layer, e) for expert e
    of an MoE block of an expert-parallel stage. Sorted by (first key, ranks), the order
    of placement.dp_groups."""
    index: dict[tuple[tuple[int, int], int], tuple[int, int]] = {}
    for g in expert_groups(plan):
        for i, rank in enumerate(g.ranks):
            index[(g.layers, rank)] = (i, len(g.ranks))
    holders: dict[tuple[tuple[int, int], int], list[int]] = {}
    for r in placements(plan):
        pipe = plan.pipelines[r.pipeline]
        for s in r.stages:
            st = pipe.stages[s]
            for layer in range(*st.layers):
                holders.setdefault(((layer, DENSE), r.tp_index), []).append(r.rank)
                if st.ep > 1 and is_moe_layer(spec, layer):
                    i, ep = index[(st.layers, r.rank)]
                    for e in local_experts(spec.config.moe.experts, ep, i):
                        holders.setdefault(((layer, e), r.tp_index), []).append(r.rank)
    by_ranks: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for (key, _), ranks in sorted(holders.items()):
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(sorted(ranks)), []).append(key)
    return sorted(((ranks, tuple(keys)) for ranks, keys in by_ranks.items()),
                  key=lambda g: (g[1][0], g[0]))


def params_by_key(modules: Sequence[nn.Module], expert_parallel: Callable[[int], bool]
                  ) -> dict[tuple[int, int], list[nn.Parameter]]:
    """A rank's parameters by reduction key (see `reduction_groups`); `modules` are its
    StageModules (names ``layers.L.mlp.experts.E...``), `expert_parallel(L)` whether
    layer L's experts are spread."""
    out: dict[tuple[int, int], list[nn.Parameter]] = {}
    for m in modules:
        for name, p in m.named_parameters():
            parts = name.split(".")
            layer = int(parts[1])
            part = int(parts[4]) if parts[2:4] == ["mlp", "experts"] and \
                expert_parallel(layer) else DENSE
            out.setdefault((layer, part), []).append(p)
    return out


def expert_reduction(plan: Plan, spec: ModelSpec, groups: list,
                     by_layer: dict[int, list[nn.Parameter]], modules: Sequence[nn.Module]
                     ) -> tuple[list, dict]:
    """The data-parallel groups and parameters-by-key a rank hands to DataParallel:
    `groups` and `by_layer` (placement.dp_groups and parameters by layer) unchanged
    without expert parallelism, else `reduction_groups` and `params_by_key` of its stage
    modules (every rank of the job switches alike: the groups are made collectively)."""
    spread = {st.layers for pipe in plan.pipelines for st in pipe.stages if st.ep > 1}
    if not spread:
        return groups, by_layer
    layers = {layer for m in modules if (m.start, m.end) in spread
              for layer in range(m.start, m.end)}
    return reduction_groups(plan, spec), params_by_key(modules, layers.__contains__)


# ---------------------------------------------------------------------------- at run time
@dataclass
class _AllToAllRecord:
    """One all-to-all this rank ran in the current action (for link emulation)."""

    group: ExpertGroup
    seq: int                        # its number among the group's all-to-alls this step
    send_bytes: list[float]         # to each rank of the group, in group order


@dataclass
class ExpertComm:
    """The all-to-alls of one rank: its process groups, the solo switch, and what each
    action ran (`records`, for link emulation; `events`, traced as they ran)."""

    rank: int
    device: str
    timeout_s: float
    clock: Callable[[], float]
    emulated: bool = False
    solo: bool = False
    step: int = 0
    action: tuple[int, int] = (-1, -1)      # (stage, micro-batch) of the current action
    records: list[_AllToAllRecord] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)
    _seq: dict[tuple[int, ...], int] = field(default_factory=dict)

    def begin_step(self, step: int) -> None:
        self.step = step
        self._seq.clear()

    def begin(self, stage: int, microbatch: int) -> None:
        """An action on (stage, microbatch) starts: its all-to-alls are recorded anew."""
        self.action = (stage, microbatch)
        self.records.clear()

    def take_events(self) -> list[TraceEvent]:
        out, self.events = self.events, []
        return out

    def exchange(self, d: Dispatcher, x: torch.Tensor, send: list[int], recv: list[int]
                 ) -> torch.Tensor:
        """All-to-all of `x`'s rows over `d`'s group: send[j] rows to rank j, recv[j] rows
        from rank j (solo: a stand-in of the same shapes, this rank's own rows)."""
        if self.solo:
            own = x.split(send)[d.index]
            return torch.cat([own if n == len(own) else x.new_zeros((n, *x.shape[1:]))
                              for n in recv])
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        seq = self._seq.get(d.group.ranks, 0)
        self._seq[d.group.ranks] = seq + 1
        self.records.append(_AllToAllRecord(d.group, seq, [n * row_bytes for n in send]))
        start = self.clock()
        wait(dist.all_to_all_single(out, x.contiguous(), recv, send, group=d.pg,
                                    async_op=True),
             self.timeout_s, f"expert all-to-all with ranks {d.group.ranks}")
        if not self.emulated:
            self.events.append(self._event(d, start, self.clock(), send, row_bytes))
        return out

    def counts(self, d: Dispatcher, mine: torch.Tensor) -> torch.Tensor:
        """(ep, E/ep) counts: row j = how many rows rank j sends to each of this rank's
        experts, from `mine` (this rank's rows for each expert, (ep, E/ep))."""
        if self.solo:
            return mine[d.index].expand_as(mine).clone()
        out = torch.empty_like(mine)
        wait(dist.all_to_all_single(out.view(-1), mine.reshape(-1).contiguous(),
                                    group=d.pg, async_op=True),
             self.timeout_s, f"expert counts with ranks {d.group.ranks}")
        return out

    def _event(self, d: Dispatcher, start: float, end: float, send: list[int],
               row_bytes: int) -> TraceEvent:
        sent = sum(n for j, n in enumerate(send) if j != d.index) * row_bytes
        peers = ",".join(d.devices[r] for r in d.group.ranks if r != self.rank)
        return TraceEvent(self.device, "alltoall", *self.action, start, end, float(sent),
                          peers, self.step)

    def emulate(self, links: Links, devices: Sequence[str]) -> list[TraceEvent]:
        """Replay the current action's all-to-alls over the emulated links, one after
        another; one ``alltoall`` event each."""
        events = []
        for rec in self.records:
            start = self.clock()
            emulate_alltoall(links, rec.group.ranks, self.rank, rec.send_bytes,
                             ("a2a", rec.group.ranks, self.step, rec.seq))
            me = rec.group.ranks.index(self.rank)
            events.append(TraceEvent(
                self.device, "alltoall", *self.action, start, self.clock(),
                float(sum(b for j, b in enumerate(rec.send_bytes) if j != me)),
                ",".join(devices[r] for r in rec.group.ranks if r != self.rank), self.step))
        self.records.clear()
        return events


def emulate_alltoall(links: Links, ranks: Sequence[int], rank: int,
                     send_bytes: Sequence[float], key: Hashable) -> None:
    """An all-to-all's link time: this rank's flow of send_bytes[j] to every other rank j
    of `ranks` leaves at once (as NCCL's all-to-all posts one send and one receive per
    peer), then it waits for every peer's flow to it. Flows from one rank to another
    queue behind each other (one connection per pair)."""
    for j, dst in enumerate(ranks):
        if dst != rank:
            links.post((key, rank, dst), rank, dst, send_bytes[j], queue=("a2a", rank, dst))
    for src in ranks:
        if src != rank:
            links.deliver((key, src, rank))


class _AllToAll(torch.autograd.Function):
    """Rows of x to the ranks of a group (send[j] to rank j, recv[j] from rank j); the
    backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, d: Dispatcher, send: list[int], recv: list[int]
                ) -> torch.Tensor:
        ctx.d, ctx.send, ctx.recv = d, send, recv
        return d.comm.exchange(d, x, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.d.comm.exchange(ctx.d, grad.contiguous(), ctx.recv, ctx.send), \
            None, None, None


class Dispatcher:
    """MoE.dispatcher for one MoE block on one rank of expert-parallel group `group`
    (process group `pg`): sends the routed rows to their experts' owners, runs this
    rank's experts on what it receives, returns the outputs (see the module doc)."""

    def __init__(self, group: ExpertGroup, pg: dist.ProcessGroup, rank: int,
                 experts: int, comm: ExpertComm, devices: Sequence[str]):
        self.group, self.pg, self.comm, self.devices = group, pg, comm, devices
        self.index = group.ranks.index(rank)
        self.ep = len(group.ranks)
        self.per = experts // self.ep

    def __call__(self, h: torch.Tensor, counts: list[int], experts: nn.ModuleDict
                 ) -> torch.Tensor:
        n, per = self.ep, self.per
        mine = torch.tensor(counts, dtype=torch.long).view(n, per)       # to each owner
        send = mine.sum(dim=1).tolist()
        theirs = self.comm.counts(self, mine)                            # (n, per)
        recv = theirs.sum(dim=1).tolist()
        x = _AllToAll.apply(h, self, send, recv)                         # (sum recv, D)
        # received: source-major, each source's rows expert by expert; regroup by expert
        order = _expert_major(theirs)
        y = run_experts(experts, self.index * per, x[order], theirs.sum(dim=0).tolist())
        back = y[torch.argsort(order)]                                   # source-major
        return _AllToAll.apply(back, self, recv, send)                   # (N, D)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder a source-major buffer (source j's rows, counts[j][e] for
    its expert e in turn) expert-major (expert e's rows from every source in turn)."""
    n, per = counts.shape
    starts = torch.cat([torch.zeros(1, dtype=torch.long),
                        counts.reshape(-1).cumsum(0)[:-1]]).view(n, per)
    pieces = [torch.arange(int(starts[j, e]), int(starts[j, e] + counts[j, e]))
              for e in range(per) for j in range(n)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


@dataclass
class ExpertParallel:
    """A rank's expert parallelism: its groups' process groups (created collectively by
    every rank, in `expert_groups` order), the experts of its stages' MoE blocks cut to
    its share, and the dispatchers' shared `comm`."""

    comm: ExpertComm
    dispatchers: list[Dispatcher] = field(default_factory=list)

    @classmethod
    def build(cls, plan: Plan, spec: ModelSpec, rank: int, stages: dict[int, nn.Module],
              comm: ExpertComm, timeout_s: float) -> ExpertParallel:
        """Create every group's process group (collective), and for this rank's
        `stages` (stage index -> StageModule) keep only its experts and set their
        dispatchers."""
        out = cls(comm)
        mine: dict[tuple[int, int], tuple[ExpertGroup, dist.ProcessGroup]] = {}
        for g in expert_groups(plan):
            pg = dist.new_group(list(g.ranks), timeout=timedelta(seconds=timeout_s))
            if rank in g.ranks:
                mine[g.layers] = (g, pg)
        for module in stages.values():
            found = mine.get((module.start, module.end))
            if found is None:
                continue
            group, pg = found
            for layer in module.layers.values():
                if isinstance(getattr(layer, "mlp", None), MoE):
                    d = Dispatcher(group, pg, rank, layer.mlp.num_experts, comm, plan.devices)
                    keep = set(local_experts(layer.mlp.num_experts, d.ep, d.index))
                    for e in range(layer.mlp.num_experts):
                        if e not in keep:
                            del layer.mlp.experts[str(e)]
                    layer.mlp.dispatcher = d
                    out.dispatchers.append(d)
        return out

    @property
    def active(self) -> bool:
        return bool(self.dispatchers)
