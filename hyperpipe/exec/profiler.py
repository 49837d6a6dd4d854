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

from hyperpipe.exec import compute
from hyperpipe.exec.emulation import compute_clock, compute_s
from hyperpipe.models import ModelSpec, build_layer, example_batch
from hyperpipe.plan.profile import Fit, Profile, model_fingerprint
from hyperpipe.progress import Progress
from hyperpipe.sim.calibrate import fit_line
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
                            seed: int = 0) -> list[tuple[float, float]]:
    """(parameters, fastest compute seconds) of an AdamW step over the first 1, 2, 4, ...
    layers of `model` and over all of them (the optimizer's per-tensor work included)."""
    counts = sorted({min(2**i, model.num_layers) for i in range(model.num_layers.bit_length())}
                    | {model.num_layers})
    out = []
    for n in counts:
        params = [torch.nn.Parameter(p.detach().clone())
                  for i in range(n) for p in build_layer(model, i, seed).parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params)
        times = []
        for rep in range(warmup + repeats):
            t0 = compute_clock()
            opt.step()
            if rep >= warmup:
                times.append(compute_s(t0, compute_clock()))
        out.append((float(sum(p.numel() for p in params)), min(times)))
    return out


def profile_layers(model: ModelSpec, device_types: dict[str, float], *,
                   micro_batches: tuple[int, ...] = (1, 2, 4), repeats: int = 10,
                   warmup: int = 2, seed: int = 0, threads: int = 1,
                   progress: bool | None = None, budget_s: float = 20.0,
                   log=None) -> Profile:
    """Measure each layer kind of `model` here and return a Profile for `device_types`
    (device type name -> time multiplier, 1.0 for this device at native speed).

    Each (layer kind, micro-batch) is held to about `budget_s` seconds: one trial round
    sets how many of the `repeats` fit (at least 2, one warm-up when fewer than asked),
    so large models finish in minutes; small ones get every repeat. `log` (a callable
    taking one line) hears of each measurement as it ends."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    first_of_kind: dict[str, int] = {}
    for i, layer in enumerate(model.layers):
        first_of_kind.setdefault(layer.kind, i)
    measured: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        with Progress(len(first_of_kind) * len(micro_batches), "profiling layers",
                      enabled=progress) as bar:
            for kind, index in sorted(first_of_kind.items()):
                for mb in micro_batches:
                    t0 = time.perf_counter()
                    measure_op_times(model, index, mb, repeats=1, warmup=0, seed=seed)
                    round_s = time.perf_counter() - t0
                    fit = int(budget_s / max(round_s, 1e-9))
                    # over budget, the trial round was the warm-up
                    reps, warm = (repeats, warmup) if fit >= repeats + warmup else \
                        (max(2, min(fit, repeats)), 0)
                    times = measure_op_times(model, index, mb, repeats=reps,
                                             warmup=warm, seed=seed)
                    if log is not None:
                        log(f"  {kind} layer, micro-batch {mb}: " + ", ".join(
                            f"{op} {t * 1e3:.1f} ms" for op, t in sorted(times.items()))
                            + f" ({reps} timed rounds, {time.perf_counter() - t0:.0f} s)")
                    for op, t in times.items():
                        measured.setdefault((kind, op), []).append(
                            (op_flops(model, index, mb, op), t))
                    bar.advance(note=f"{kind} mb={mb}")
        optimizer = fit_line(*zip(*measure_optimizer_times(model, seed=seed), strict=True))
    finally:
        torch.set_num_threads(old_threads)
    native = {(kind, op): fit_line([f for f, _ in pts], [t for _, t in pts])
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


def measure_profile(model_ref, cluster_ref=None, *, micro_batches: tuple[int, ...] = (1, 2, 4),
                    emulate: bool = True, emulation_scale: float = 1.0,
                    progress: bool | None = None, log=None) -> Profile:
    """`hyperpipe calibrate --measure`: profile `model_ref` here, with entries for every
    device type of `cluster_ref` stretched as the executor emulates them (or a single
    ``local`` type when no cluster is given)."""
    from hyperpipe.cluster.cluster import load_cluster
    from hyperpipe.exec.emulation import emulation_factors
    from hyperpipe.models import load_model
    model = load_model(model_ref)
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
