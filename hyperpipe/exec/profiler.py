"""Per-layer profiling on the local device, without a pipeline run.

Like Metis and HAPT, which profile each layer kind on each GPU type, this measures the
forward (F), input-gradient (I), weight-gradient (W) and full backward (B) time of one
layer of each kind of a model, at several micro-batch sizes (warm-up, then the fastest
of the repeats, as the executor's emulation reference takes it),
fits time = a + b·FLOPs per (kind, op), and an AdamW step's time = a + b·parameters,
and writes the usual calibration Profile.

On a CPU standing in for a hypothetical cluster, `device_types` maps each device type to
the factor its compute is stretched by under emulation (see exec.emulation), so that the
profile predicts the emulated run.
"""

from __future__ import annotations

import platform
import socket
import time

import torch

from hyperpipe.core.errors import BadInput
from hyperpipe.core.progress import Progress
from hyperpipe.exec import compute
from hyperpipe.exec.emulation import compute_clock, compute_s
from hyperpipe.models import ModelSpec, build_layer, example_batch
from hyperpipe.plan.profile import Fit, Profile, model_fingerprint
from hyperpipe.sim.calibrate import fit_bulk, fit_line
from hyperpipe.sim.costmodel import op_flops

OPS = ("F", "I", "W", "B")


def _layer_inputs(model: ModelSpec, index: int, micro_batch: int, seed: int):
    """(input, targets) for layer `index` alone: token ids for the embedding, floats
    (B, S, D) needing grad for the others, targets for the last layer."""
    tokens, targets = example_batch(model, micro_batch, seed)
    if index == 0 and model.config is not None:
        return tokens, targets
    layer = model.layers[index]
    width = model.config.d_model if model.config is not None else layer.hidden
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batch, model.seq_len, width, generator=gen, requires_grad=True)
    return x, targets


def measure_op_times(model: ModelSpec, index: int, micro_batch: int, *, repeats: int = 5,
                     warmup: int = 2, seed: int = 0) -> dict[str, float]:
    """Fastest CPU seconds of F, I, W and B of layer `index` for one micro-batch, each
    run through the executor's own compute functions (exec.compute)."""
    layer = build_layer(model, index, seed)
    params = list(layer.parameters())
    x, targets = _layer_inputs(model, index, micro_batch, seed)
    last = index == model.num_layers - 1
    cut = index == 0 and model.config is not None
    samples: dict[str, list[float]] = {op: [] for op in OPS}
    clock = compute_clock  # compute seconds, as the executor's emulation stretches them
    for rep in range(warmup + repeats):
        t0 = clock()
        entry = compute.forward([layer], x, targets if last else None, cut_after_first=cut)
        t1 = clock()
        out = entry[1]
        grad = None if last else torch.randn_like(out)
        t2 = clock()
        compute.input_grad(params, entry, grad)
        t3 = clock()
        compute.weight_grad(params, entry)
        t4 = clock()
        entry = compute.forward([layer], x, targets if last else None, cut_after_first=cut)
        t5 = clock()
        compute.backward(entry, grad)
        t6 = clock()
        layer.zero_grad(set_to_none=True)
        if x.is_floating_point():
            x.grad = None
        if rep >= warmup:
            for op, a, b in (("F", t0, t1), ("I", t2, t3), ("W", t3, t4), ("B", t5, t6)):
                samples[op].append(compute_s(a, b))
    return {op: min(v) for op, v in samples.items()}   # as the executor's reference


def measure_optimizer_times(model: ModelSpec, *, repeats: int = 10, warmup: int = 2,
                            seed: int = 0, budget_s: float = 3.0,
                            done=None) -> list[tuple[float, float]]:
    """(parameters, fastest compute seconds) of an AdamW step over the first 1, 2, 4, ...
    layers of `model` and over all of them (the optimizer's per-tensor work included).

    Each count is held to about `budget_s`: the first step (it allocates the moments) is
    the warm-up when the `repeats` do not fit, then as many steps as fit (at least one).
    `done` (a callable taking the count) hears of each count as it ends."""
    counts = sorted({min(2**i, model.num_layers) for i in range(model.num_layers.bit_length())}
                    | {model.num_layers})
    layers = [list(build_layer(model, i, seed).parameters()) for i in range(max(counts))]
    for p in (p for ps in layers for p in ps):
        p.grad = torch.zeros_like(p)
    out = []
    for n in counts:
        params = [p for ps in layers[:n] for p in ps]
        opt = torch.optim.AdamW(params)
        t0 = compute_clock()
        opt.step()
        first_s = compute_s(t0, compute_clock())
        fit = int(budget_s / max(first_s, 1e-9))
        reps, warm = (repeats, warmup - 1) if fit >= repeats + warmup else \
            (max(1, min(fit, repeats)), 0)
        times = []
        for rep in range(warm + reps):
            t0 = compute_clock()
            opt.step()
            if rep >= warm:
                times.append(compute_s(t0, compute_clock()))
        out.append((float(sum(p.numel() for p in params)), min(times)))
        if done is not None:
            done(n)
    return out


def _round(model: ModelSpec, index: int, mb: int, seed: int, repeats: int, warmup: int,
           budget_s: float) -> tuple[dict[str, float], int, float]:
    """(fastest seconds per op, timed rounds, seconds of one round) of layer `index` at
    micro-batch `mb`, held to about `budget_s`: a trial round sets how many of the
    `repeats` fit; over budget, the trial round is the warm-up and counts among the
    samples (the fastest is kept), and at least one more round is timed."""
    t0 = time.perf_counter()
    trial = measure_op_times(model, index, mb, repeats=1, warmup=0, seed=seed)
    round_s = time.perf_counter() - t0
    fit = int(budget_s / max(round_s, 1e-9))
    if fit >= repeats + warmup:
        return measure_op_times(model, index, mb, repeats=repeats, warmup=warmup,
                                seed=seed), repeats, round_s
    reps = max(1, min(fit, repeats))
    times = measure_op_times(model, index, mb, repeats=reps, warmup=0, seed=seed)
    return {op: min(t, trial[op]) for op, t in times.items()}, reps, round_s


def profile_layers(model: ModelSpec, device_types: dict[str, float], *,
                   micro_batches: tuple[int, ...] = (1, 2, 4), repeats: int = 10,
                   warmup: int = 2, seed: int = 0, threads: int = 1,
                   progress: bool | None = None, budget_s: float = 8.0,
                   log=None) -> Profile:
    """Measure each layer kind of `model` here and return a Profile for `device_types`
    (device type name -> time multiplier, 1.0 for this device at native speed).

    Each layer kind is timed once (its first layer), not every layer. Each (layer kind,
    micro-batch) is held to about `budget_s` seconds (see `_round`), so large models
    finish in minutes and small ones get every repeat; a kind already timed at two
    sizes skips a larger size whose round would take over twice the budget (the fit is
    linear in FLOPs, so two sizes determine it). `log` (a callable taking one line)
    hears of each measurement as it ends."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    first_of_kind: dict[str, int] = {}
    for i, layer in enumerate(model.layers):
        first_of_kind.setdefault(layer.kind, i)
    sizes = sorted(set(micro_batches))
    n_opt = len({min(2**i, model.num_layers) for i in range(model.num_layers.bit_length())}
                | {model.num_layers})
    measured: dict[tuple[str, str], list[tuple[float, float]]] = {}
    skipped: list[str] = []
    say = log if log is not None else (lambda line: None)
    try:
        with Progress(len(first_of_kind) * len(sizes) + n_opt, "profiling layers",
                      enabled=progress) as bar:
            for kind, index in sorted(first_of_kind.items()):
                done: list[tuple[int, float]] = []         # (micro-batch, round seconds)
                for mb in sizes:
                    if len(done) >= 2 and done[-1][1] * mb / done[-1][0] > 2 * budget_s:
                        skipped.append(f"{kind}@{mb}")
                        say(f"  {kind} layer, micro-batch {mb}: skipped (one round would "
                            f"take about {done[-1][1] * mb / done[-1][0]:.0f} s; the fit "
                            f"in FLOPs over micro-batches {[m for m, _ in done]} covers it)")
                        bar.advance(note=f"{kind} mb={mb} skipped")
                        continue
                    t0 = time.perf_counter()
                    times, reps, round_s = _round(model, index, mb, seed, repeats, warmup,
                                                  budget_s)
                    done.append((mb, round_s))
                    say(f"  {kind} layer, micro-batch {mb}: " + ", ".join(
                        f"{op} {t * 1e3:.1f} ms" for op, t in sorted(times.items()))
                        + f" ({reps} timed round{'s' if reps != 1 else ''}, "
                        f"{time.perf_counter() - t0:.0f} s)")
                    for op, t in times.items():
                        measured.setdefault((kind, op), []).append(
                            (op_flops(model, index, mb, op), t))
                    bar.advance(note=f"{kind} mb={mb}")
            say(f"  timing an AdamW step over 1 to {model.num_layers} layers ...")
            t0 = time.perf_counter()
            opt_points = measure_optimizer_times(
                model, seed=seed, done=lambda n: bar.advance(note=f"AdamW {n} layers"))
            optimizer = fit_line(*zip(*opt_points, strict=True))
            params, step_s = opt_points[-1]
            say(f"  AdamW step: {step_s * 1e3:.1f} ms for {params / 1e6:.1f} M parameters "
                f"({time.perf_counter() - t0:.0f} s)")
    finally:
        torch.set_num_threads(old_threads)
    # over one size (or a narrow span) a line cannot tell a per-call time from a
    # per-FLOP one: time proportional to FLOPs (`fit_bulk`), not a constant that would
    # price every micro-batch size as the one measured
    native = {(kind, op): fit_bulk([f for f, _ in pts], [t for _, t in pts])
              for (kind, op), pts in sorted(measured.items())}
    compute = {Profile.key(dtype, kind, op): _scaled(fit, factor)
               for (kind, op), fit in native.items()
               for dtype, factor in sorted(device_types.items())}
    return Profile(compute=compute, optimizer={
        dtype: _scaled(optimizer, factor) for dtype, factor in sorted(device_types.items())},
        provenance={
        "method": "layer profiling", "model": model.name,
        "model_fingerprint": model_fingerprint(model), "host": socket.gethostname(),
        "platform": platform.platform(), "torch": torch.__version__, "threads": threads,
        "micro_batches": list(micro_batches), "repeats": repeats,
        "skipped": skipped, "budget_s": budget_s,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "emulated": any(f != 1.0 for f in device_types.values()),
        "device_types": dict(device_types)})


def _scaled(fit: Fit, factor: float) -> Fit:
    return Fit(fit.a_s * factor, fit.b_s_per_unit * factor, fit.samples, fit.rel_rmse)


def emulated_profile(native: Profile, factors: dict[str, float]) -> Profile:
    """A native-speed profile (every device type at factor 1) with each device type's
    compute stretched by its emulation factor: what emulated runs will take."""
    compute = {k: _scaled(f, factors.get(k.split("|")[0], 1.0))
               for k, f in native.compute.items()}
    optimizer = {k: _scaled(f, factors.get(k, 1.0)) for k, f in native.optimizer.items()}
    prov = {**native.provenance, "emulated": any(f != 1.0 for f in factors.values()),
            "device_types": dict(factors)}
    return Profile(compute, dict(native.links), optimizer, dict(native.allreduce),
                   dict(native.overhead), prov)


FP32 = 4                      # bytes per value: the profile runs in fp32 on this CPU
STATE_VALUES = 4              # per parameter: weight, gradient, Adam's two moments


def profile_memory_bytes(model: ModelSpec, micro_batches: tuple[int, ...]) -> float:
    """Predicted peak bytes of `profile_layers`: the larger of one layer's F/I/W/B at the
    largest micro-batch (its stash held twice, input, output and their gradients, weights
    and gradients) and the optimizer timing's state of every layer."""
    mb = max(micro_batches)
    layer_peak = 0.0
    for layer in {layer.kind: layer for layer in model.layers}.values():
        cost = layer.cost(mb, model.seq_len, FP32)
        layer_peak = max(layer_peak, 2 * cost.stash_bytes + 4 * cost.send_bytes
                         + 2 * FP32 * layer.params)
    state = STATE_VALUES * FP32 * sum(layer.params for layer in model.layers)
    return max(layer_peak, state)


def check_profile_memory(model: ModelSpec, micro_batches: tuple[int, ...],
                         host_bytes: float | None) -> None:
    """BadInput (before anything is allocated) when `profile_memory_bytes` is over the
    host's available bytes (None: unknown, not checked)."""
    need = profile_memory_bytes(model, micro_batches)
    if host_bytes is not None and need > host_bytes:
        raise BadInput("--micro-batches", f"sizes whose profile of {model.name} fits this "
                       f"host: predicted {need / 1e9:.1f} GB at micro-batch "
                       f"{max(micro_batches)}, and this host has {host_bytes / 1e9:.1f} GB "
                       "available", max(micro_batches))


def measure_profile(model_ref, cluster_ref=None, *, micro_batches: tuple[int, ...] = (1, 2, 4),
                    emulate: bool = True, emulation_scale: float = 1.0,
                    progress: bool | None = None, log=None,
                    host_bytes: float | None = None) -> Profile:
    """`hyperpipe calibrate --measure`: profile `model_ref` here, with entries for every
    device type of `cluster_ref` stretched as the executor emulates them (or a single
    ``local`` type when no cluster is given). `host_bytes`: the memory available here;
    a profile predicted not to fit it is BadInput before any work."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.exec.emulation import emulation_factors
    from hyperpipe.models import load_model
    model = load_model(model_ref)
    check_profile_memory(model, tuple(micro_batches), host_bytes)
    if cluster_ref is None:
        factors = {"local": 1.0}
    else:
        cluster = load_cluster(cluster_ref)
        factors = emulation_factors(cluster, emulation_scale) if emulate else \
            {name: 1.0 for name in cluster.device_types}
    if log is not None:
        kinds = sorted({layer.kind for layer in model.layers})
        log(f"profiling F/I/W/B of {len(kinds)} layer kinds of {model.name} "
            f"({', '.join(kinds)}) at micro-batches {list(micro_batches)} on this CPU ...")
    return profile_layers(model, factors, micro_batches=micro_batches, progress=progress,
                          log=log)
