"""Plans: how a model is cut into stages, which devices run them, and the schedule each
pipeline runs.

A plan is plain data with a JSON round trip (format ``hyperpipe.plan/1``): data-parallel
replicas ("pipelines", which may differ from one another), each a list of stages
(half-open layer range, devices, tensor-parallel degree) with its own micro-batch size
and count. With v chunks a pipeline of p devices has p·v stages, stage k on the devices
of stage `stage_rank(k, p, placement)`: k mod p (looped), or for the V kinds 2p - 1 - k
beyond the first p. A kind that carries actions (`synth`) holds per-device action lists,
``schedule.actions``, in the IR's text form: ``{"a100/0": ["0F0", "0F1", "0I0", ...]}``,
keyed by each pipeline rank's first device. `schedule_for` is the one place the simulator
and the executor get a pipeline's schedule from, so they replay the same order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hyperpipe.core import limits
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import Fields, load_document, whole_number, write_atomic
from hyperpipe.plan.kinds import (
    DEFAULT_KIND,
    KINDS,
    SYNTH,
    default_chunks,
    generate,
    over_action_limit,
    schedule_kind,
)
from hyperpipe.plan.schedule import Action, Schedule, ScheduleError, stage_rank, validate
from hyperpipe.plan.stack import (
    DECAY_ONLY_KINDS,
    DEFAULT_STACK,
    EXPERT_PLACEMENTS,
    GRAD_REDUCE_DTYPES,
    MOE_DISPATCHERS,
    NO_OVERRIDES,
    P2P_KINDS,
    RUNTIME_KEYS,
    SHARD_KINDS,
    STACKS,
    Runtime,
    RuntimeOverrides,
    resolve_runtime,
)

ActionLists = tuple[tuple[str, tuple[Action, ...]], ...]     # (device, its actions), sorted

PLAN_FORMAT = "hyperpipe.plan/1"

# Activation recompute per stage (Korthikanti et al. 2022, arXiv 2205.05198): "none" keeps
# every activation for the backward; "selective" recomputes the attention core (the s²
# scores, softmax and dropout) in the backward; "full" keeps only each block's input and
# runs the whole block forward again in the backward. The first value is the default.
RECOMPUTE_KINDS = ("none", "selective", "full")
# ZeRO stages (Rajbhandari et al. 2020, sec. 5): 0 plain data parallelism; 1 optimizer
# state sharded over the data-parallel group (Megatron's distributed optimizer); 2 the
# gradients too; 3 the parameters too (FSDP's FULL_SHARD).
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[int, int]          # half-open [start, end)
    devices: tuple[str, ...]         # the tensor-parallel group, "NODE/INDEX" names
    tp: int = 1
    recompute: str = "none"          # one of RECOMPUTE_KINDS
    sequence_parallel: bool = False  # Korthikanti et al.'s sequence parallelism (tp > 1)
    # Context parallelism: the sequence split over cp ranks, each a tensor-parallel group
    # of tp devices; `devices` holds tp x cp names, tensor-parallel rank innermost
    # (device c·tp + t is tensor rank t of context rank c), as Megatron-LM orders its
    # ranks (megatron/core/parallel_state.py, order "tp-cp-ep-dp-pp").
    cp: int = 1
    # Expert parallelism of the stage's MoE blocks (`hyperpipe.models.spec.MoEBlock`):
    # their routed experts split over ep ranks carved out of the data-parallel x context
    # ranks holding the stage (Megatron-Core: expert-data-parallel = dp·tp·cp/(ep·etp),
    # here with etp = tp, megatron/core/parallel_state.py `initialize_model_parallel`;
    # DeepSeek-V3 trains EP 64 across 8 nodes beside its data parallelism). The group of
    # tensor rank t: ep consecutive entries of [replica q's devices[c·tp + t] for each
    # replica q holding the stage's layers, for c in range(cp)] (`sim.experts`).
    ep: int = 1

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_KINDS:
            raise ValueError(f"recompute must be one of {RECOMPUTE_KINDS}, "
                             f"got {self.recompute!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs a tensor-parallel stage (tp > 1)")
        if self.cp < 1:
            raise ValueError(f"cp must be a positive integer, got {self.cp!r}")
        if self.ep < 1:
            raise ValueError(f"ep must be a positive integer, got {self.ep!r}")

    @property
    def tp_group(self) -> tuple[str, ...]:
        """The first context rank's tensor-parallel group (every context rank's group
        moves alike)."""
        return self.devices[:self.tp]

    def context_rank(self, c: int) -> tuple[str, ...]:
        """The tensor-parallel group of context rank `c`."""
        return self.devices[c * self.tp:(c + 1) * self.tp]

    def to_dict(self) -> dict[str, Any]:
        """The stage's JSON form; optional fields only when they differ from the default,
        so that plans without them are written as before."""
        out: dict[str, Any] = {"layers": list(self.layers), "devices": list(self.devices),
                               "tp": self.tp}
        if self.recompute != "none":
            out["recompute"] = self.recompute
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.cp != 1:
            out["cp"] = self.cp
        if self.ep != 1:
            out["ep"] = self.ep
        return out

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class PipelinePlan:
    micro_batch: int                 # samples per micro-batch
    num_microbatches: int
    stages: tuple[StagePlan, ...]

    @property
    def samples(self) -> int:
        return self.micro_batch * self.num_microbatches

    def devices(self) -> list[str]:
        """Every device of the pipeline, each once, in stage order."""
        seen: dict[str, None] = {}
        for s in self.stages:
            for d in s.devices:
                seen.setdefault(d, None)
        return list(seen)


@dataclass(frozen=True)
class Plan:
    model: str | dict                # built-in name, path (relative to the plan) or inline
    cluster: str | dict
    global_batch: int
    schedule: str                    # a kind of hyperpipe.plan.kinds.KINDS
    chunks: int
    pipelines: tuple[PipelinePlan, ...]
    actions: ActionLists | None = None   # a kind that carries actions: its lists
    # The training stack it runs on (`hyperpipe.plan.stack.STACKS`) and the runtime
    # choices it overrides; `runtime_settings` resolves the two.
    stack: str = DEFAULT_STACK
    runtime: RuntimeOverrides = NO_OVERRIDES
    base_dir: Path | None = field(default=None, compare=False)
    source: str = field(default="plan", compare=False)   # the file it came from, for errors
    # ZeRO stage (ZERO_STAGES) over each layer range's data-parallel group: the replicas
    # holding it times each stage's context ranks.
    zero: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES}, got {self.zero!r}")

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1 / Megatron's distributed optimizer and up: the optimizer state (fp32
        master weights and Adam moments) sharded over the data-parallel group (zero >= 1;
        files may say it as ``"distributed_optimizer": true``, read as zero 1)."""
        return self.zero >= 1

    # ------------------------------------------------------------------ stack
    def runtime_settings(self) -> Runtime:
        """How the plan's stack runs it: the stack's defaults with the plan's overrides."""
        return resolve_runtime(self.stack, self.runtime)

    def stack_refusal(self, model) -> str | None:
        """Why this plan's stack cannot run it on `model` (ModelSpec), in one line, or
        None: on a stack with `Runtime.flattens_param_groups` for the model's dtype, a
        stage whose layers are all of `DECAY_ONLY_KINDS` leaves the group of biases and
        norms empty. The simulator and the analytic tier report it as
        `Metrics.refused`."""
        if model.storage_dtype not in self.runtime_settings().flattens_param_groups:
            return None
        for q, pipe in enumerate(self.pipelines):
            for k, st in enumerate(pipe.stages):
                if all(model.layers[i].kind in DECAY_ONLY_KINDS for i in range(*st.layers)):
                    return (f"pipelines[{q}].stages[{k}] holds only the embedding: on "
                            f"{self.stack} with {model.dtype} its optimizer cannot flatten "
                            "an empty group of biases and norms")
        return None

    def on_stack(self, stack: str | None = None, **overrides: Any) -> Plan:
        """This plan on `stack` (None: its own) with the runtime `overrides` given
        (``p2p``, ``overlap_grad_reduce``, ``grad_reduce_dtype``,
        ``reshard_after_forward``) over its own."""
        runtime = RuntimeOverrides(**{**self.runtime.given(), **overrides})
        return replace(self, stack=self.stack if stack is None else stack, runtime=runtime)

    # ------------------------------------------------------------------ shape
    def num_devices(self, pipeline: int = 0) -> int:
        """p: pipeline ranks of one pipeline (stages / chunks)."""
        return len(self.pipelines[pipeline].stages) // self.chunks

    @property
    def devices(self) -> list[str]:
        return [d for p in self.pipelines for d in p.devices()]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON form (optional fields only when not at their default)."""
        out: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "model": self.model,
            "cluster": self.cluster,
            "global_batch": self.global_batch,
            "schedule": self._schedule_dict(),
            "stack": self.stack,
        }
        if self.runtime.given():
            out["runtime"] = self.runtime.given()
        if self.zero == 1:          # written as before `zero` existed
            out["distributed_optimizer"] = True
        elif self.zero >= 2:
            out["zero"] = self.zero
        out["pipelines"] = [
            {"micro_batch": p.micro_batch, "num_microbatches": p.num_microbatches,
             "stages": [s.to_dict() for s in p.stages]}
            for p in self.pipelines]
        return out

    def _schedule_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.schedule, "chunks": self.chunks}
        if self.actions:
            out["actions"] = actions_to_dict(self.actions)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.to_json())

    def with_pipelines(self, pipelines: list[PipelinePlan]) -> Plan:
        return replace(self, pipelines=tuple(pipelines))

    def with_memory(self, recompute: str | None = None, sequence_parallel: bool | None = None,
                    distributed_optimizer: bool | None = None, zero: int | None = None
                    ) -> Plan:
        """This plan with the given memory options on every stage (sequence parallelism
        on the tensor-parallel ones) and for the plan; None keeps what it has.
        `distributed_optimizer` true raises zero 0 to 1 and false sets zero 0; `zero`,
        when given, wins."""
        def stage(s: StagePlan) -> StagePlan:
            return replace(s, recompute=s.recompute if recompute is None else recompute,
                           sequence_parallel=s.sequence_parallel if sequence_parallel is None
                           else sequence_parallel and s.tp > 1)
        pipes = [replace(p, stages=tuple(map(stage, p.stages))) for p in self.pipelines]
        z = self.zero
        if distributed_optimizer is not None:
            z = max(z, 1) if distributed_optimizer else 0
        if zero is not None:
            z = zero
        return replace(self, pipelines=tuple(pipes), zero=z)

    # ------------------------------------------------------------------ resolving refs
    def load_model(self, override: Any = None):
        """The ModelSpec this plan names (or `override`, e.g. from --model); errors name
        the plan's file and its `model` field, or the override's."""
        from hyperpipe.models import load_model
        if override is not None:
            return load_model(override, base_dir=self.base_dir)
        return load_model(self.model, base_dir=self.base_dir, where=f"{self.source}: model")

    def load_cluster(self, override: Any = None):
        """The Cluster this plan names (or `override`, e.g. from --cluster); errors name
        the plan's file and its `cluster` field, or the override's."""
        from hyperpipe.cluster.cluster import load_cluster
        if override is not None:
            return load_cluster(override, base_dir=self.base_dir)
        return load_cluster(self.cluster, base_dir=self.base_dir,
                            where=f"{self.source}: cluster")

    # ------------------------------------------------------------------ checks
    def check(self, model, cluster, *, where: str | None = None) -> None:
        """Raise BadInput unless this plan fits `model` (ModelSpec) and `cluster` (Cluster):
        layers covered exactly once and in order, devices exist and each is used by one
        stage (one per chunk for interleaved), batch sizes add up, known schedule kind."""
        where = self.source if where is None else where
        kind = KINDS.get(self.schedule)
        if kind is None:
            raise BadInput(f"{where}: schedule.kind", f"one of {sorted(KINDS)}", self.schedule)
        if not kind.allows_chunks(self.chunks):
            raise BadInput(f"{where}: schedule.chunks", kind.chunks_rule(), self.chunks)
        total = sum(p.samples for p in self.pipelines)
        if total != self.global_batch:
            raise BadInput(f"{where}: global_batch", "the sum over pipelines of micro_batch x "
                           f"num_microbatches ({total})", self.global_batch)
        owner: dict[str, str] = {}
        for i, pipe in enumerate(self.pipelines):
            pw = f"{where}: pipelines[{i}]"
            if len(pipe.stages) % self.chunks:
                raise BadInput(f"{pw}.stages", f"a multiple of chunks={self.chunks} stages",
                               len(pipe.stages))
            p = len(pipe.stages) // self.chunks
            pos = 0
            for k, st in enumerate(pipe.stages):
                sw = f"{pw}.stages[{k}]"
                a, b = st.layers
                if a != pos:
                    what = "overlapping" if a < pos else "missing"
                    raise BadInput(f"{sw}.layers", f"to start at layer {pos} ({what} layers "
                                   f"{min(a, pos)}..{max(a, pos)})", list(st.layers))
                if b <= a:
                    raise BadInput(f"{sw}.layers", "a non-empty half-open range [start, end)",
                                   list(st.layers))
                pos = b
                if len(st.devices) != st.tp * st.cp:
                    what = f"tp={st.tp} devices" if st.cp == 1 else \
                        f"tp x cp = {st.tp} x {st.cp} = {st.tp * st.cp} devices"
                    raise BadInput(f"{sw}.devices", what, list(st.devices))
                misfit = tp_misfit(model, st.tp, st.sequence_parallel, st.cp)
                if misfit is not None:
                    raise BadInput(f"{sw}.tp", f"a divisor of the model's {misfit[0]} "
                                   f"({misfit[1]}): tensor parallelism splits it", st.tp)
                if cp_misfit(model, st.cp):
                    raise BadInput(f"{sw}.cp", CP_RULE.format(seq_len=model.seq_len), st.cp)
                for d in st.devices:
                    if not cluster.has_device(d):
                        raise BadInput(f"{sw}.devices", f"devices of cluster {cluster.name!r} "
                                       f"named NODE/INDEX (e.g. {cluster.devices[0].name})", d)
                h = home_stage(self, pipe, k)
                if k >= p and st.devices != pipe.stages[h].devices:
                    raise BadInput(f"{sw}.devices", f"the devices of stage {h} "
                                   f"({placement_rule(self, pipe)})", list(st.devices))
                if k < p:
                    for d in st.devices:
                        if d in owner:
                            rule = "each device in one stage only (" if self.chunks == 1 \
                                else (f"a device of its own among the first {p} stages "
                                      f"({placement_rule(self, pipe)}; ")
                            raise BadInput(f"{sw}.devices", f"{rule}also used by {owner[d]})",
                                           d)
                        owner[d] = sw
                if len({cluster.device(d).type.name for d in st.devices}) > 1:
                    raise BadInput(f"{sw}.devices", "one device type across the stage's "
                                   "devices (its tensor" + (" and context" if st.cp > 1 else "")
                                   + "-parallel ranks)", list(st.devices))
            if pos != model.num_layers:
                raise BadInput(f"{pw}.stages", f"layers covering 0..{model.num_layers} of model "
                               f"{model.name!r}", f"coverage ending at {pos}")
        check_expert_parallel(self, model, where)
        check_actions(self, where)


def check_expert_parallel(plan: Plan, model, where: str) -> None:
    """Raise BadInput unless every stage's `ep` can hold the model's experts: ep divides
    the experts; ep divides the data-parallel x context ranks holding the stage (the
    replicas whose stage holding the same first layer, times cp), and those replicas'
    stages are alike in layers, tp, cp, ep and micro-batch (an expert-parallel group
    exchanges the same layers' tokens)."""
    moe = getattr(model.config, "moe", None) if model.config is not None else None
    for i, pipe in enumerate(plan.pipelines):
        for k, st in enumerate(pipe.stages):
            if st.ep == 1:
                continue
            sw = f"{where}: pipelines[{i}].stages[{k}].ep"
            if moe is None:
                raise BadInput(sw, f"1 (model {model.name!r} has no MoE blocks)", st.ep)
            if moe.experts % st.ep:
                raise BadInput(sw, f"a divisor of the model's experts ({moe.experts})",
                               st.ep)
            peers = [(q, other, next(s for s in other.stages
                                     if s.layers[0] <= st.layers[0] < s.layers[1]))
                     for q, other in enumerate(plan.pipelines)]
            for q, other, ost in peers:
                if (ost.layers, ost.tp, ost.cp, ost.ep, other.micro_batch) != \
                        (st.layers, st.tp, st.cp, st.ep, pipe.micro_batch):
                    raise BadInput(sw, "the same layers, tp, cp, ep and micro_batch in "
                                   "every replica holding them (the expert-parallel group "
                                   f"spans replicas; pipelines[{q}] differs)", st.ep)
            ranks = len(peers) * st.cp
            if ranks % st.ep:
                raise BadInput(sw, f"a divisor of the data-parallel x context ranks "
                               f"holding the stage ({len(peers)} x {st.cp} = {ranks}): "
                               "expert ranks are carved out of them", st.ep)


_TOP_KEYS = ("format", "model", "cluster", "global_batch", "schedule", "pipelines", "notes",
             "distributed_optimizer", "zero", "stack", "runtime")
_STAGE_KEYS = ("layers", "devices", "tp", "recompute", "sequence_parallel", "cp", "ep")


def _flag(f: Fields, key: str) -> bool:
    """An optional true/false field (absent: false)."""
    value = f.raw(key, False)
    if not isinstance(value, bool):
        raise BadInput(f.at(key), "true or false", value)
    return value


def _runtime(top: Fields) -> RuntimeOverrides:
    """The plan's optional ``runtime`` overrides (each key optional)."""
    if not top.has("runtime"):
        return NO_OVERRIDES
    rf = top.sub("runtime", RUNTIME_KEYS)
    p2p = rf.choice("p2p", P2P_KINDS) if rf.has("p2p") else None
    overlap = rf.raw("overlap_grad_reduce", None)
    if overlap is not None and not isinstance(overlap, bool):
        raise BadInput(rf.at("overlap_grad_reduce"), "true or false", overlap)
    dtype = rf.choice("grad_reduce_dtype", GRAD_REDUCE_DTYPES) \
        if rf.has("grad_reduce_dtype") else None
    reshard = rf.raw("reshard_after_forward", None)
    if reshard is not None and not isinstance(reshard, bool):
        raise BadInput(rf.at("reshard_after_forward"), "true or false", reshard)
    placement = rf.choice("expert_placement", EXPERT_PLACEMENTS) \
        if rf.has("expert_placement") else None
    shard = rf.choice("shard", SHARD_KINDS) if rf.has("shard") else None
    dispatcher = rf.choice("moe_dispatcher", MOE_DISPATCHERS) \
        if rf.has("moe_dispatcher") else None
    return RuntimeOverrides(p2p, overlap, dtype, reshard, placement, shard, dispatcher)


def plan_from_dict(data: Any, *, where: str = "plan", base_dir: Path | None = None) -> Plan:
    """Check the shape of a plan document (not yet against its model and cluster)."""
    top = Fields(data, where, _TOP_KEYS)
    fmt = top.raw("format", None)
    if fmt != PLAN_FORMAT:
        raise BadInput(top.at("format"), f"{PLAN_FORMAT!r}", fmt)
    model = top.raw("model")
    cluster = top.raw("cluster")
    for key, value in (("model", model), ("cluster", cluster)):
        if not isinstance(value, (str, dict)) or not value:
            raise BadInput(top.at(key), "a built-in name, a file path or an inline mapping",
                           value)
    sched = top.raw("schedule", {})          # absent: Megatron-LM's default kind
    actions = None
    if isinstance(sched, str):
        kind, chunks = sched, default_chunks(sched)
    else:
        sf = Fields(sched, top.at("schedule"), ("kind", "chunks", "actions"))
        kind = sf.string("kind", DEFAULT_KIND)
        chunks = sf.positive_int("chunks", default_chunks(kind), at_most=limits.MAX_CHUNKS)
        if sf.has("actions"):
            actions = parse_actions(sf.raw("actions"), sf.at("actions"))
    pipelines = []
    raw_pipes = top.items("pipelines")
    if not raw_pipes:
        raise BadInput(top.at("pipelines"), "at least one pipeline", raw_pipes)
    for i, raw in enumerate(raw_pipes):
        pf = Fields(raw, f"{where}: pipelines[{i}]", ("micro_batch", "num_microbatches",
                                                       "stages"))
        stages = []
        raw_stages = pf.items("stages")
        if not raw_stages:
            raise BadInput(pf.at("stages"), "at least one stage", raw_stages)
        for k, rs in enumerate(raw_stages):
            sf = Fields(rs, f"{pf.where}.stages[{k}]", _STAGE_KEYS)
            layers = [whole_number(x) for x in sf.items("layers")]    # 5.0, 5e0: 5
            if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                           and 0 <= x <= limits.MAX_CUT_UNITS for x in layers):
                raise BadInput(sf.at("layers"),
                               f"[start, end] with integers from 0 to {limits.MAX_CUT_UNITS}",
                               layers)
            devices = sf.items("devices")
            if not devices or not all(isinstance(d, str) for d in devices):
                raise BadInput(sf.at("devices"), "a non-empty list of device names "
                               "(NODE/INDEX)", devices)
            cp = sf.positive_int("cp", 1, at_most=limits.MAX_CONTEXT_PARALLEL)
            tp = sf.positive_int("tp", len(devices) // cp or 1,
                                 at_most=limits.MAX_NODE_DEVICES)
            recompute = sf.choice("recompute", RECOMPUTE_KINDS, "none")
            seq_par = _flag(sf, "sequence_parallel")
            if seq_par and tp == 1:
                raise BadInput(sf.at("sequence_parallel"), "false on a stage with tp=1 "
                               "(sequence parallelism splits tensor-parallel activations)",
                               seq_par)
            ep = sf.positive_int("ep", 1, at_most=limits.MAX_NODE_DEVICES * 64)
            stages.append(StagePlan((layers[0], layers[1]), tuple(devices), tp, recompute,
                                    seq_par, cp, ep))
        pipelines.append(PipelinePlan(
            pf.positive_int("micro_batch", at_most=limits.MAX_GLOBAL_BATCH),
            pf.positive_int("num_microbatches", at_most=limits.MAX_MICROBATCHES),
            tuple(stages)))
    global_batch = top.positive_int("global_batch", at_most=limits.MAX_GLOBAL_BATCH)
    stack = top.choice("stack", list(STACKS), DEFAULT_STACK)
    return Plan(model=model, cluster=cluster, global_batch=global_batch,
                schedule=kind, chunks=chunks, pipelines=tuple(pipelines), actions=actions,
                zero=_zero(top), base_dir=base_dir,
                source=where, stack=stack, runtime=_runtime(top))


def _zero(top: Fields) -> int:
    """The plan's ZeRO stage: ``zero`` (0-3), or 1 for ``distributed_optimizer: true``;
    BadInput when the two disagree."""
    dist_opt = _flag(top, "distributed_optimizer")
    if not top.has("zero"):
        return 1 if dist_opt else 0
    zero = whole_number(top.raw("zero"))
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise BadInput(top.at("zero"), "0, 1, 2 or 3 (ZeRO stage: 1 shards the optimizer "
                       "state, 2 the gradients too, 3 the parameters too)", zero)
    if top.has("distributed_optimizer") and dist_opt != (zero >= 1):
        raise BadInput(top.at("distributed_optimizer"), f"{str(zero >= 1).lower()} with "
                       f"zero {zero} (zero 1 and up shard the optimizer state), or left out",
                       dist_opt)
    return zero


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    return plan_from_dict(load_document(p), where=str(p), base_dir=p.resolve().parent)


# ---------------------------------------------------------------- the schedule it runs
def parse_actions(data: Any, where: str) -> ActionLists:
    """Read ``schedule.actions`` (device -> list of ``"2F0"`` strings); BadInput names the
    device and step of the first bad entry."""
    if not isinstance(data, Mapping) or not data:
        raise BadInput(where, "a mapping of device name to a list of actions like '0F0'",
                       data)
    out = []
    for device, row in data.items():
        if not isinstance(device, str) or not device:
            raise BadInput(where, "device names (NODE/INDEX) as keys", device)
        if not isinstance(row, list):
            raise BadInput(f"{where}[{device!r}]", "a list of actions like '0F0'", row)
        actions = []
        for step, text in enumerate(row):
            try:
                actions.append(Action.from_str(text))
            except ScheduleError:
                raise BadInput(f"{where}[{device!r}] step {step}", "an action like '2F0' "
                               "(stage, op in F/B/I/W, micro-batch)", text) from None
        out.append((device, tuple(actions)))
    return tuple(sorted(out))


def actions_to_dict(actions: ActionLists) -> dict[str, list[str]]:
    """The JSON form of `parse_actions`' result."""
    return {device: [str(a) for a in row] for device, row in actions}


def ring_member(ring: int, degree: int, largest: int) -> int:
    """The tensor index, in a stage of tensor-parallel `degree`, that joins data-parallel
    ring `ring` of a layer whose replicas' largest degree is `largest` (a multiple of
    `degree`): the rank holding slice `ring` of the layer's gradients cut in `largest`
    slices. The simulator, the analytic tier and the executor form the rings alike."""
    return ring * degree // largest


def pipeline_placement(plan: Plan, pipe: PipelinePlan) -> str:
    """``v`` or ``loop``: fixed by the kind, or for a kind that carries actions read off
    the stages' devices (V when stage p sits with stage p - 1)."""
    kind = schedule_kind(plan.schedule)
    if not kind.carries_actions:
        return kind.placement
    p = len(pipe.stages) // plan.chunks
    if plan.chunks > 1 and p > 1 and pipe.stages[p].devices == pipe.stages[p - 1].devices:
        return "v"
    return "loop"


def plan_over_action_limit(plan: Plan) -> str | None:
    """Why some pipeline's generated schedule would be over the action limit (the
    simulator and executor could not build it), or None. Synthesised plans carry their
    actions and are never over."""
    if schedule_kind(plan.schedule).carries_actions:
        return None
    for pipe in plan.pipelines:
        over = over_action_limit(plan.schedule, len(pipe.stages) // plan.chunks,
                                 pipe.num_microbatches, plan.chunks)
        if over:
            return over
    return None


def schedule_for(plan: Plan, q: int = 0) -> Schedule:
    """The schedule pipeline `q` of `plan` runs (not validated; `check_actions` does)."""
    pipe = plan.pipelines[q]
    p = len(pipe.stages) // plan.chunks
    if not schedule_kind(plan.schedule).carries_actions:
        return generate(plan.schedule, p, pipe.num_microbatches, plan.chunks)
    lists = dict(plan.actions or ())
    rows = []
    for d in range(p):
        device = pipe.stages[d].devices[0]
        if device not in lists:
            raise BadInput(f"{plan.source}: schedule.actions", f"an action list for device "
                           f"{device!r} (pipeline {q} rank {d})", sorted(lists))
        rows.append(lists[device])
    return Schedule(plan.schedule, p, len(pipe.stages), pipe.num_microbatches, tuple(rows),
                    pipeline_placement(plan, pipe))


def check_actions(plan: Plan, where: str) -> None:
    """BadInput unless `schedule.actions` is there exactly for a kind that carries actions,
    covers the plan's ranks and no other device, and every pipeline's lists validate (the
    message names the device and step)."""
    if not schedule_kind(plan.schedule).carries_actions:
        if plan.actions:
            raise BadInput(f"{where}: schedule.actions", "no action lists unless kind is "
                           f"'{SYNTH}'", plan.schedule)
        return
    if not plan.actions:
        raise BadInput(f"{where}: schedule.actions", f"per-device action lists for kind "
                       f"'{SYNTH}'", None)
    used = set()
    valid: set[Schedule] = set()           # replicas alike share their lists: check once
    for q, pipe in enumerate(plan.pipelines):
        sched = schedule_for(plan, q)
        names = [pipe.stages[d].devices[0] for d in range(sched.num_devices)]
        used.update(names)
        count = sum(len(row) for row in sched.actions)
        if count > limits.MAX_SCHEDULE_ACTIONS:      # as for a generated kind's schedule
            raise BadInput(f"{where}: schedule.actions", f"at most "
                           f"{limits.MAX_SCHEDULE_ACTIONS} actions per pipeline "
                           "(hyperpipe.core.limits)", f"{count} in pipeline {q}")
        if sched in valid:
            continue
        try:
            validate(sched)
        except ScheduleError as err:
            text = re.sub(r"rank (\d+)", lambda mt, names=names: f"device {names[int(mt[1])]}",
                          str(err))
            raise _bad(where, f"pipeline {q}: {text}") from None
        valid.add(sched)
    extra = sorted(set(dict(plan.actions)) - used)
    if extra:
        raise BadInput(f"{where}: schedule.actions", "lists only for the first device of "
                       "each pipeline rank", extra[0])


def _bad(where: str, text: str) -> BadInput:
    err = BadInput(f"{where}: schedule.actions", "a runnable order", None, has_got=False)
    err.args = (f"{where}: schedule.actions: {text}",)
    return err


def tp_split_sizes(model, tp: int, sequence_parallel: bool = False, cp: int = 1
                   ) -> list[tuple[str, int]]:
    """(name, size) of what tensor parallelism of `tp` splits evenly over its ranks, as
    Megatron-LM requires (megatron/core: attention heads and query groups per partition,
    the MLP's and the experts' columns, with sequence parallelism each context rank's
    tokens): n_head, n_kv_head, ffn_hidden and moe.expert_hidden of a GPT model,
    seq_len / cp with `sequence_parallel`; empty for tp 1 and for synthetic models."""
    c = getattr(model, "config", None)
    if tp == 1 or c is None:
        return []
    sizes = [("n_head", c.n_head), ("n_kv_head", c.n_kv_head), ("ffn_hidden", c.ffn_hidden)]
    if c.moe is not None:
        sizes.append(("moe.expert_hidden", c.moe.expert_hidden))
    if sequence_parallel and c.seq_len % cp == 0:     # (a cp that does not split the
        sizes.append(("seq_len / cp", c.seq_len // cp))  # sequence is refused as such)
    return sizes


CP_RULE = ("a degree that splits the sequence ({seq_len}) into 2 x cp equal chunks (causal "
           "load balancing: two chunks per context rank)")


def cp_misfit(model, cp: int) -> bool:
    """Whether context parallelism of `cp` cannot split `model`'s sequence (`CP_RULE`):
    the one rule `Plan.check`, the search and the CLI's --cp share."""
    return cp > 1 and model.seq_len % (2 * cp) != 0


def tp_misfit(model, tp: int, sequence_parallel: bool = False, cp: int = 1
              ) -> tuple[str, int] | None:
    """The first of `tp_split_sizes` that `tp` does not divide (None: it splits them all):
    the one rule `Plan.check`, the search's degrees and the CLI's --tp share."""
    return next(((name, size) for name, size in
                 tp_split_sizes(model, tp, sequence_parallel, cp) if size % tp), None)


def placement_rule(plan: Plan, pipe: PipelinePlan) -> str:
    """Where a pipeline's chunks go, in words for an error message (`home_stage`): with p
    ranks, looped placement puts stage k on the devices of stage k mod p, V placement
    puts chunk c's i-th stage on those of stage i (c even) or p - 1 - i (c odd)."""
    p = len(pipe.stages) // plan.chunks
    what = f"{plan.schedule} with chunks {plan.chunks}"
    if pipeline_placement(plan, pipe) == "v":
        return (f"V placement of {what}: stage k = c*{p} + i on the devices of stage i in "
                f"an even chunk c and of stage {p - 1} - i in an odd one")
    return f"looped placement of {what}: stage k on the devices of stage k mod {p}"


def home_stage(plan: Plan, pipe: PipelinePlan, k: int) -> int:
    """The stage among the first p whose devices stage k shares (its rank)."""
    p = len(pipe.stages) // plan.chunks
    return stage_rank(k, p, pipeline_placement(plan, pipe))
