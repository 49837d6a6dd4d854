"""Expert parallelism: who exchanges tokens with whom, what the all-to-all costs, how long
an expert-parallel rank computes its experts, and what it holds. Both tiers (the
simulator's programs and the analytic tier) price it here, through the cost model, so
they agree. Times in seconds, sizes in bytes.

**Groups.** A stage's `ep` ranks are carved out of the data-parallel x context ranks
holding it (`StagePlan.ep`, Megatron-Core's rule with expert tensor parallelism = tp,
megatron/core/parallel_state.py): listing, for every replica holding the stage's layers
and each context rank c, the device c·tp + t of tensor rank t, each ep consecutive
entries form a group (`ep_groups`). Routed experts (`MoEBlock.expert_params`) are split
over a group; the rest of the block (attention, router, shared experts) is replicated
and reduced over the usual data-parallel group, the experts over their
expert-data-parallel group of dp·cp / ep ranks (`expert_dp_rings`).

**All-to-all** (Megatron-Core's `MoEAlltoAllTokenDispatcher`; DeepSeek-V3, arXiv
2412.19437, sec. 3.2.2): per MoE block, the dispatch before the experts and the combine
after them in the forward, and their transposes in the backward (I or B; with full
recompute the forward's pair again). A rank holds T = b·s / (cp·tp) tokens (the tensor
group splits its tokens, as Megatron-Core's dispatcher does with sequence parallelism,
which it requires with ep and tp together) and sends each other rank of its group the
pairs routed to that rank's experts, P(T)·h·d / ep bytes (P: `MoEConfig.routed_pairs`,
dropped pairs are not sent), so (ep - 1)/ep · P(T)·h·d bytes per rank and direction.
That is the "alltoall" dispatcher (`runtime.moe_dispatcher`); "deepep" sends a token
once per destination rank inside the node and once per destination node across nodes,
however many of its experts are there (`alltoall_edge_bytes`).
Every group of the stage exchanges at once, over the real routes (NVLink ports inside a
node, NICs shared by a node's GPUs across nodes, `cluster.path`): on idle links one
exchange takes the most loaded hop's bytes over its achievable bandwidth (link
bandwidth x `Cluster.bus_efficiency`: the sender's `collective_efficiency` inside a
node, host-staged without peer-to-peer, `nic_efficiency` across), plus the slowest
route's latency (`alltoall_time_s`). The simulator runs a stage's exchanges of one
action as one flow over those hops (`alltoall_spec`).

**Overlap.** 1F1B-like schedules run one micro-batch's block at a time, so the
all-to-all sits between the router and the experts on the critical path: it follows the
action's compute. DualPipe (DeepSeek-V3, sec. 3.2.1; deepseek-ai/DualPipe) pairs a
forward chunk of one micro-batch with a backward chunk of another and runs one's
all-to-all under the other's compute: for `dualpipe-v`, an action whose neighbour on its
rank runs the other direction (a forward next to a backward) runs its all-to-all beside
its compute (`overlaps_alltoall`). The other kinds overlap none; the synthesised
schedules are priced as their order runs them, without DualPipe's pairing.

**Expert compute.** A rank's experts at ep 1 take the routed experts' share of the
layer's time (`routed_expert_s`); in a group each rank computes the pairs routed to its
experts, and the group waits for its slowest rank (the combine cannot end before every
rank has computed): with the busiest expert (`MoEConfig.imbalance`) on the rank where it
costs most, rank r with n_r experts computes `rank_pairs(ep·T, n_r)` pairs. Placement
"even": experts / ep each (a router cannot know device speeds); "speed"
(`runtime.expert_placement`): experts in proportion to each rank's speed at this work,
largest remainders, at least one each (`expert_counts`). Under a profile that prices an MoE
block at the dense block's fit, a rank launches only its own experts' MLPs
(`CostModel.expert_launch_delta_s`).

**Memory.** A rank holds its share of the routed experts' weights, gradients and
optimizer state, sharded with ZeRO over its expert-data-parallel group
(`expert_state`), and stashes the dispatched tokens and expert intermediates of the
pairs routed to its experts (`expert_stash_extra_bytes`).

ZeRO-2/3 gather and reduce-scatter a rank's share of an MoE block's routed experts over
its expert-data-parallel ring (`sharding.fsdp_extra_s`), and ZeRO-3's unsharded working
set counts that share only (`CostModel.zero3_working_bytes`).

Left out: the all-to-all's transient send and receive buffers.
"""

from __future__ import annotations

from collections import Counter

from hyperpipe.models.ops import routed_expert_work
from hyperpipe.plan.kinds import schedule_kind
from hyperpipe.plan.plan import Plan, StagePlan, schedule_for
from hyperpipe.sim.compute import pass_time_s
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.network import FlowSpec
from hyperpipe.sim.replicas import stage_holding


def moe_layers(cost: CostModel, layers: tuple[int, int]) -> list[int]:
    """The MoE blocks among layers [a, b)."""
    return [i for i in range(*layers) if cost.model.layers[i].kind == "moe"]


def _members(plan: Plan, q: int, k: int) -> list[tuple[int, int]]:
    """(replica, context rank) of every rank holding stage k of pipeline q's layers, in
    group order (replica outer, context rank inner)."""
    first = plan.pipelines[q].stages[k].layers[0]
    out = []
    for r, pipe in enumerate(plan.pipelines):
        st = pipe.stages[stage_holding(pipe.stages, first)]
        out += [(r, c) for c in range(st.cp)]
    return out


def _device(plan: Plan, first: int, member: tuple[int, int], t: int) -> str:
    r, c = member
    stages = plan.pipelines[r].stages
    st = stages[stage_holding(stages, first)]
    return st.devices[c * st.tp + t]


def ep_groups(plan: Plan, q: int, k: int, t: int = 0) -> list[tuple[str, ...]]:
    """Every expert-parallel group of tensor rank `t` among the ranks holding stage k of
    pipeline q's layers (see the module doc); one group of one device each when ep = 1."""
    st = plan.pipelines[q].stages[k]
    first = st.layers[0]
    members = _members(plan, q, k)
    devices = [_device(plan, first, m, t) for m in members]
    return [tuple(devices[g:g + st.ep]) for g in range(0, len(devices), st.ep)]


def own_group(plan: Plan, q: int, k: int) -> tuple[str, ...]:
    """The expert-parallel group (tensor rank 0) holding pipeline q's stage k (context
    rank 0)."""
    dev = plan.pipelines[q].stages[k].devices[0]
    return next(g for g in ep_groups(plan, q, k) if dev in g)


def expert_dp_rings(plan: Plan, q: int, k: int) -> list[list[str]]:
    """The rings that reduce the experts' gradients of stage k of pipeline q: for each
    tensor rank and each position in a group, the ranks at that position in every group
    (the dp·cp / ep replicas of the same experts)."""
    st = plan.pipelines[q].stages[k]
    rings = []
    for t in range(st.tp):
        groups = ep_groups(plan, q, k, t)
        rings += [[g[e] for g in groups] for e in range(st.ep)]
    return rings


def alltoall_pair_bytes(cost: CostModel, stage: StagePlan, micro_batch: int) -> float:
    """Bytes one rank sends each other rank of its group in one dispatch (or combine) of
    one MoE block under the "alltoall" dispatcher: P(T)·h·d / ep with T = b·s / (cp·tp)
    (see the module doc)."""
    moe, tokens, token_bytes = _exchange_terms(cost, stage, micro_batch)
    return moe.routed_pairs(tokens) * token_bytes / stage.ep


def _exchange_terms(cost: CostModel, stage: StagePlan, micro_batch: int):
    """(MoEConfig, tokens T a rank holds, bytes of one token's hidden state) of the
    stage's MoE blocks."""
    layer = next(cost.model.layers[i] for i in moe_layers(cost, stage.layers))
    tokens = micro_batch * cost.model.seq_len / (stage.cp * stage.tp)
    return layer.moe, tokens, layer.config.d_model * cost.model.dtype_bytes


def alltoall_edge_bytes(cost: CostModel, stage: StagePlan, micro_batch: int,
                        edges: list[tuple[str, str]] | tuple[tuple[str, str], ...],
                        dispatcher: str = "alltoall") -> list[float]:
    """Bytes each (sender, receiver) of `edges` carries in one dispatch (or combine) of
    one MoE block (`plan.stack.MOE_DISPATCHERS`):

    - "alltoall": `alltoall_pair_bytes` on every edge;
    - "deepep": a token crosses to a rank of its own node once if any of its experts is
      there, T·h·d · hit(experts of the rank), and to another node once if any is on
      that node, T·h·d · hit(experts of the group's n ranks there) / n, spread evenly
      over those n receivers (DeepEP sends each token to the same-index GPU of every
      target node, which forwards it over NVLink; that forward is not priced: NVLink
      runs several times a GPU's NIC share). hit = `MoEConfig.hit_fraction` of the
      experts ranks hold under even placement (E / ep consecutive each, taken from
      expert 0), times the routed pairs' share that capacity keeps.

    A rank's receivers on each node are counted from `edges`, so they must list every
    member of its group."""
    if dispatcher == "alltoall":
        return [alltoall_pair_bytes(cost, stage, micro_batch)] * len(edges)
    moe, tokens, token_bytes = _exchange_terms(cost, stage, micro_batch)
    kept = moe.routed_pairs(tokens) / (tokens * moe.top_k)
    per_rank = moe.experts // stage.ep
    node = {d: cost.cluster.device(d).node for e in edges for d in e}
    there: Counter[tuple[str, str]] = Counter((a, node[b]) for a, b in edges)
    hit: dict[int, float] = {}

    def share(n: int) -> float:
        if n not in hit:
            hit[n] = moe.hit_fraction(range(n * per_rank)) / n
        return hit[n]
    return [tokens * token_bytes * kept * (share(1) if node[a] == node[b]
                                           else share(there[a, node[b]]))
            for a, b in edges]


def alltoall_edges(plan: Plan, q: int, k: int) -> list[tuple[str, str]]:
    """Every (sender, receiver) pair of every group of the stage, every tensor rank."""
    st = plan.pipelines[q].stages[k]
    return [(a, b) for t in range(st.tp) for g in ep_groups(plan, q, k, t)
            for a in g for b in g if a != b]


def alltoall_time_s(cost: CostModel, edges: list[tuple[str, str]],
                    edge_bytes: list[float]) -> tuple[float, float, dict[str, float]]:
    """(seconds, of which latency, hop -> its busy seconds) of `edges` each sending its
    `edge_bytes` at once, on idle links: the most loaded hop's bytes over its achievable
    bandwidth (hop bandwidth x `Cluster.bus_efficiency`), plus the slowest route's
    latency."""
    busy: Counter[str] = Counter()
    lat = 0.0
    for (a, b), nbytes in zip(edges, edge_bytes, strict=True):
        route, link = cost.route(a, b)
        if not route.hops:
            continue
        eff = cost.cluster.bus_efficiency(a, route.link_class)
        lat = max(lat, link.latency_s)
        for hop in route.hops:
            busy[hop.name] += nbytes / (hop.bandwidth_bytes_per_s * eff)
    if not busy:
        return 0.0, 0.0, {}
    return max(busy.values()) + lat, lat, dict(busy)


def alltoall_count(cost: CostModel, stage: StagePlan, op: str) -> int:
    """All-to-alls one action of the stage runs: 2 per MoE block in F (dispatch and
    combine) and in a backward that carries input gradients (B or I; with full recompute
    the forward's 2 again); none in W, and none with ep = 1."""
    if stage.ep == 1 or op == "W":
        return 0
    per = 2 if op == "F" else (4 if stage.recompute == "full" else 2)
    return per * len(moe_layers(cost, stage.layers))


def alltoall_spec(cost: CostModel, plan: Plan, q: int, k: int, op: str,
                  members: list[int] | None = None) -> FlowSpec | None:
    """The all-to-alls of one action of stage k of pipeline q as one flow: the sends of
    `members`' ranks (the replicas a simulated pipeline stands for; None: every
    replica), `alltoall_count` exchanges. Each hop's weight is its busy time from these
    sends over the flow's work (the busiest hop's, weight 1), so flows of several
    replica classes that cross one hop load it by their bytes together, and the
    exchange of every class at once takes `alltoall_time_s` of all the groups' sends.
    None when there is none."""
    st = plan.pipelines[q].stages[k]
    n = alltoall_count(cost, st, op)
    if n == 0:
        return None
    mb = plan.pipelines[q].micro_batch
    senders = None if members is None else frozenset(
        d for r in members for d in plan.pipelines[r].stages[k].devices)
    key = ("a2a", st, mb, op, alltoall_edges_key(plan, q, k), senders,
           plan.runtime_settings().moe_dispatcher)
    table = cost.memo("experts", dict)
    if key not in table:
        every = alltoall_edges(plan, q, k)
        nbytes = alltoall_edge_bytes(cost, st, mb, every,
                                     plan.runtime_settings().moe_dispatcher)
        kept = [i for i, (a, _) in enumerate(every) if senders is None or a in senders]
        edges = [every[i] for i in kept]
        _, lat, busy = alltoall_time_s(cost, edges, [nbytes[i] for i in kept])
        unit = max(busy.values(), default=0.0)
        first = edges[0][0] if edges else None
        sent = sum(nbytes[i] for i in kept if every[i][0] == first)
        table[key] = None if unit <= 0 else FlowSpec(
            tuple((hop, busy[hop] / unit) for hop in sorted(busy)), n * unit, n * lat,
            n * sent)
    return table[key]


def alltoall_s(cost: CostModel, plan: Plan, q: int, k: int, op: str) -> float:
    """Seconds of the all-to-alls of one action of stage k of pipeline q on otherwise
    idle links, every group exchanging at once (`alltoall_time_s` x `alltoall_count`)."""
    spec = alltoall_spec(cost, plan, q, k, op)
    return 0.0 if spec is None else spec.time_s


def alltoall_edges_key(plan: Plan, q: int, k: int) -> tuple[str, ...]:
    """The devices of the stage's groups (what its all-to-all's cost depends on)."""
    return tuple(d for g in ep_groups(plan, q, k) for d in g)


def overlaps_alltoall(plan: Plan, ops: list[str], i: int) -> bool:
    """Whether action i of a rank's row (ops) runs its all-to-all beside its compute:
    with a kind that `overlaps_alltoall` (DualPipe-V), when the action before or after it
    on the rank runs the other direction (DualPipe's forward-backward pair)."""
    if not schedule_kind(plan.schedule).overlaps_alltoall:
        return False
    fwd = ops[i] == "F"
    return any(0 <= j < len(ops) and (ops[j] == "F") != fwd for j in (i - 1, i + 1))


def paired_fraction(plan: Plan, q: int, k: int, op: str) -> float:
    """The fraction of stage k's `op` actions in pipeline q's schedule that run their
    all-to-all beside their compute (`overlaps_alltoall`), B and I counted together
    (both carry the backward's all-to-alls); 0 for other kinds."""
    if not schedule_kind(plan.schedule).overlaps_alltoall:
        return 0.0
    sched = schedule_for(plan, q)
    like = ("B", "I") if op in ("B", "I") else (op,)
    hits = total = 0
    for row in sched.actions:
        ops = [a.op for a in row]
        for i, a in enumerate(row):
            if a.stage == k and a.op in like:
                total += 1
                hits += overlaps_alltoall(plan, ops, i)
    return hits / total if total else 0.0


def routed_expert_s(cost: CostModel, layer: int, device_type: str, micro_batch: int,
                    op: str, tp: int = 1, sequence_parallel: bool = False, cp: int = 1
                    ) -> float:
    """Seconds of the routed experts' part of one MoE layer's `op` on one device at ep 1
    (no slowdown): their GEMMs and kernels at the device's GEMM curve, or, on the flat
    roofline or under a calibration profile, the layer's time x their share of its
    FLOPs."""
    spec = cost.model.layers[layer]
    passes = ("I", "W") if op == "B" else (op,)
    dev = cost.cluster.device_types[device_type]
    if dev.gemm is not None and cost.profile is None:
        return sum(pass_time_s(dev, routed_expert_work(spec, p, micro_batch,
                                                       cost.model.seq_len,
                                                       cost.model.dtype_bytes, tp,
                                                       sequence_parallel, cp),
                               cost.model.dtype_bytes, cost.model.dtype)
                   for p in passes)
    total = cost.layer_time_s(layer, device_type, micro_batch, op, tp, sequence_parallel, cp)
    flops = sum(routed_expert_work(spec, p, micro_batch, cost.model.seq_len,
                                   cost.model.dtype_bytes, tp, sequence_parallel, cp).flops
                for p in passes)
    whole = cost.op_flops(layer, micro_batch, op) / (tp * cp)
    return total * flops / whole if whole > 0 else 0.0


def expert_counts(times_s: list[float], experts: int, placement: str) -> list[int]:
    """Experts per rank of a group whose ranks take `times_s` for the same expert work:
    "even" experts / ep each; "speed" in proportion to 1 / time (largest remainders, at
    least one each)."""
    n = len(times_s)
    if placement == "even" or n == 1:
        return [experts // n] * n
    speed = [1.0 / t if t > 0 else 1.0 for t in times_s]
    share = [experts * s / sum(speed) for s in speed]
    counts = [max(1, int(x)) for x in share]
    while sum(counts) > experts:
        j = max((j for j in range(n) if counts[j] > 1), key=lambda j: counts[j] - share[j])
        counts[j] -= 1
    while sum(counts) < experts:
        j = max(range(n), key=lambda j: share[j] - counts[j])
        counts[j] += 1
    return counts


def expert_extra_s(cost: CostModel, plan: Plan, q: int, k: int, op: str) -> float:
    """Seconds expert parallelism changes one `op` of stage k of pipeline q by, beyond
    `CostModel.stage_time_s` (which prices every expert on the rank, ep 1): the group's
    slowest rank's expert time (see the module doc) less this rank's own at ep 1, over
    the stage's MoE blocks, and again for the recomputed forward of a full-recompute
    backward. 0 with ep = 1."""
    st = plan.pipelines[q].stages[k]
    if st.ep == 1 or not moe_layers(cost, st.layers):
        return 0.0
    mb = plan.pipelines[q].micro_batch
    placement = plan.runtime_settings().expert_placement
    group = own_group(plan, q, k)
    key = ("extra", st, group, mb, op, placement)
    table = cost.memo("experts", dict)
    if key not in table:
        passes = [op]
        if op in ("B", "I") and st.recompute == "full":
            passes.append("F")
        table[key] = sum(_group_extra_s(cost, st, group, mb, p, i, placement)
                         for p in passes for i in moe_layers(cost, st.layers))
    return table[key]


def _group_extra_s(cost: CostModel, st: StagePlan, group: tuple[str, ...], mb: int,
                   op: str, layer: int, placement: str) -> float:
    cluster = cost.cluster
    times = [routed_expert_s(cost, layer, cluster.device(d).type.name, mb, op, st.tp,
                             st.sequence_parallel, st.cp) * cluster.slowdown((d,))
             for d in group]
    moe = cost.model.layers[layer].moe
    tokens = mb * cost.model.seq_len / st.cp
    counts = expert_counts(times, moe.experts, placement)
    base = moe.routed_pairs(tokens)
    # under a dense-rate profile a rank launches the MLPs of its own n experts only
    slowest = max(t * moe.rank_pairs(st.ep * tokens, n) / base + cluster.slowdown((d,)) *
                  cost.expert_launch_delta_s(layer, cluster.device(d).type.name, mb, op,
                                             st.tp, st.cp, n)
                  for t, n, d in zip(times, counts, group, strict=True))
    own = routed_expert_s(cost, layer, cluster.device(st.devices[0]).type.name, mb, op,
                          st.tp, st.sequence_parallel, st.cp) * cluster.slowdown(st.devices)
    return slowest - own


def expert_share(cost: CostModel, plan: Plan, q: int, k: int) -> float:
    """The fraction of the stage's routed experts a rank holds (its experts / all, the
    largest in its group): 1 with ep = 1."""
    st = plan.pipelines[q].stages[k]
    if st.ep == 1 or not moe_layers(cost, st.layers):
        return 1.0
    moe = cost.model.layers[moe_layers(cost, st.layers)[0]].moe
    placement = plan.runtime_settings().expert_placement
    mb = plan.pipelines[q].micro_batch
    group = own_group(plan, q, k)
    layer = moe_layers(cost, st.layers)[0]
    times = [routed_expert_s(cost, layer, cost.cluster.device(d).type.name, mb, "F", st.tp,
                             st.sequence_parallel, st.cp) * cost.cluster.slowdown((d,))
             for d in group]
    counts = expert_counts(times, moe.experts, placement)
    return counts[group.index(st.devices[0])] / moe.experts


def expert_stash_extra_bytes(cost: CostModel, plan: Plan, q: int, k: int) -> float:
    """Bytes one micro-batch's stash of stage k of pipeline q holds beyond
    `CostModel.stage_stash_bytes` under expert parallelism: a rank keeps the dispatched
    tokens and expert intermediates of the pairs routed to its experts from the whole
    group, `rank_pairs(ep·T, n)` with the busiest expert on it, where the spec counts
    its own tokens' P(T) (`MoEBlock.stash_parts`: h·d per pair outside the
    tensor-parallel region, (2|4)·fe·d inside it). None with full recompute (only the
    block input is kept) or ep = 1."""
    st = plan.pipelines[q].stages[k]
    if st.ep == 1 or st.recompute == "full" or not moe_layers(cost, st.layers):
        return 0.0
    mb = plan.pipelines[q].micro_batch
    share = expert_share(cost, plan, q, k)
    total = 0.0
    for i in moe_layers(cost, st.layers):
        layer = cost.model.layers[i]
        moe, c = layer.moe, layer.config
        tokens = mb * cost.model.seq_len / st.cp
        d = cost.model.dtype_bytes
        per_pair = (4 if c.mlp == "swiglu" else 2) * moe.expert_hidden * d / st.tp + \
            c.d_model * d / (st.tp if st.sequence_parallel else 1)
        here = moe.rank_pairs(st.ep * tokens, round(share * moe.experts))
        total += (here - moe.routed_pairs(tokens)) * per_pair
    return total


def expert_state(cost: CostModel, plan: Plan, stage: StagePlan) -> tuple[float, int | None]:
    """(share of the routed experts, ranks their state is sharded over) of a plan stage,
    for `CostModel.state_bytes`: (1, None) with ep = 1; else its rank's share
    (`expert_share`) and, with ZeRO 1 and up, its expert-data-parallel group's size,
    dp·cp / ep (else 1)."""
    if stage.ep == 1 or not moe_layers(cost, stage.layers):
        return 1.0, None
    q, k = next((q, k) for q, pipe in enumerate(plan.pipelines)
                for k, st in enumerate(pipe.stages) if st is stage or st == stage)
    shards = len(_members(plan, q, k)) // stage.ep if plan.zero >= 1 else 1
    return expert_share(cost, plan, q, k), shards


__all__ = ["alltoall_count", "alltoall_edge_bytes", "alltoall_edges", "alltoall_pair_bytes",
           "alltoall_s", "alltoall_spec", "alltoall_time_s", "ep_groups", "expert_counts",
           "expert_dp_rings", "expert_extra_s", "expert_share", "expert_stash_extra_bytes",
           "expert_state", "moe_layers", "overlaps_alltoall", "own_group",
           "paired_fraction", "routed_expert_s"]
