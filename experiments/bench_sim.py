"""Simulator speed, measured in one process on this machine, against its targets.

Prints, side by side:

* raw SimPy: one process yielding N timeouts (events per second): the floor any
  SimPy model pays per event;
* the simulator's throughput in IR actions per second: `simulate` end to end (schedule
  generation, preparation, the event run, metrics and trace) on one long pipeline
  (gpt3-13b, 16 stages across two nodes of the scale-1024 cluster, 256 micro-batches,
  1F1B: 8192 actions, real point-to-point transfers over NVLink and a NIC), and the
  event run alone (the part the SimPy comparison is about);
* the wall time of simulating one iteration of a 1024-GPU plan (PP 16 x DP 64, 64
  micro-batches, 1F1B, gpt3-13b on scale-1024), with a fresh cost model (cold) and
  with a warm one;
* without replica symmetry: the end-to-end wall time (loading the cluster and model,
  building the plan and its schedule, simulating with the trace off, metrics) of the
  same 1024-GPU plan with one device (the first) at `slowdown: 1.3`, and of a 16,384-GPU
  plan of the same shape scaled up (scale-1024's nodes repeated 16 times, PP 16 x DP
  1024); replicas are grouped into exact classes (the straggler's, its NIC
  neighbours', the rest); as the oracle, the 1024-GPU plan with every replica simulated
  on its own (`collapse_replicas=False`, once; skip with --no-full), whose iteration
  time the collapsed run must equal;
* the analytic tier's time per plan: 24 distinct 1024-GPU plans (pp 4/8/16,
  micro-batch 1/2, four schedules), one cost model, the search's shared cache; and the
  same without the cache (every look-up cold).

Each figure is the best of several repetitions (the machine may be shared). The last
line is ``actions_per_s=A simpy_events_per_s=S ratio=A/S sim_1024gpu_s=T
analytic_per_plan_s=E sim_1024gpu_asym_s=X sim_16k_asym_s=Y`` with A the event run's
throughput (the SimPy phase, which is
what the ratio to raw SimPy events is about; the end-to-end figures above it add
schedule generation and, with the trace, building one TraceEvent per action and
message), T the cold 1024-GPU time and E the per-plan time with the cache. Targets:
ratio >= 0.25, T <= 1 s, E <= 1 ms, X <= 2 s, Y <= 30 s; then
``zero_cp_max_gap=G``: the analytic tier against the simulator on the short lists of
searches whose plans use ZeRO 1-3 and context parallelism (`SHARDED_SEARCHES`),
target G <= 0.05.

Run: python experiments/bench_sim.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time

import simpy

from hyperpipe.cluster.cluster import cluster_from_dict, load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.baselines import uniform_plan
from hyperpipe.sim.analytic import estimate
from hyperpipe.sim.analytic_cache import AnalyticCache
from hyperpipe.sim.costmodel import CostModel
from hyperpipe.sim.simulator import SimOptions, _Engine, simulate


def simpy_events_per_s(n: int) -> float:
    env = simpy.Environment()

    def ticker():
        for _ in range(n):
            yield env.timeout(1.0)

    env.process(ticker())
    t = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t)


def best(fn, reps: int) -> float:
    """Smallest wall time of `fn()` over `reps` runs."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def engine_run_s(plan, cost) -> float:
    """Wall time of the event run alone (after preparation, before results)."""
    engine = _Engine(plan, cost, SimOptions(), None)
    for pipe in engine.pipes:
        for rank in pipe.ranks:
            engine.env.process(engine._rank_process(rank))
    t = time.perf_counter()
    engine.env.run()
    return time.perf_counter() - t


def straggler_cluster_doc(scale: int) -> dict:
    """scale-1024's document with every node group repeated `scale` times more and the
    first node's first device at slowdown 1.3 (one straggler)."""
    doc = copy.deepcopy(load_cluster("scale-1024").source)
    nodes = [{**n, "repeat": n.get("repeat", 1) * scale} for n in doc["nodes"]]
    first = nodes[0]
    doc["nodes"] = [{**first, "name": f"{first['name']}slow", "repeat": 1,
                     "slowdown": {0: 1.3}},
                    {**first, "repeat": first["repeat"] - 1}, *nodes[1:]]
    doc["name"] = f"scale-{1024 * scale}-straggler"
    return doc


def asym_run(scale: int, collapse: bool = True):
    """Load, plan (PP 16 x DP 64·scale, 64 micro-batches, 1F1B), simulate (trace off),
    metrics: the end-to-end job of `simulate` on the straggler cluster."""
    doc = straggler_cluster_doc(scale)
    model = load_model("gpt3-13b")
    cluster = cluster_from_dict(doc, where="bench", name=doc["name"])
    dp = 64 * scale
    plan = uniform_plan(model, cluster, pp=16, dp=dp, micro_batch=1, global_batch=64 * dp)
    return simulate(plan, CostModel(model, cluster),
                    SimOptions(trace=False, collapse_replicas=collapse)).metrics


def asym_figures(reps: int, full: bool) -> tuple[float, float]:
    out = []
    for scale, label in ((1, "1024-GPU"), (16, "16,384-GPU")):
        secs = best(lambda s=scale: asym_run(s), reps if scale == 1 else max(1, reps // 3))
        m = asym_run(scale)
        classes = [len(c) for c in m.extra["replica_classes"]]
        print(f"{label} plan, one device at slowdown 1.3 (PP16 x DP{64 * scale}, 64 "
              f"micro-batches, 1F1B, gpt3-13b), load+plan+simulate+metrics, trace off: "
              f"{secs:.3f} s; iteration {m.iteration_time_s:.4f} s; replica classes of "
              f"{classes} replicas, {m.extra['simulated_actions']} actions simulated")
        out.append((secs, m))
    if full:
        t = time.perf_counter()
        m = asym_run(1, collapse=False)
        secs = time.perf_counter() - t
        ref = out[0][1].iteration_time_s
        print(f"oracle: the 1024-GPU straggler plan with every replica simulated on its own: "
              f"{secs:.1f} s, {m.extra['simulated_actions']} actions; iteration "
              f"{m.iteration_time_s:.6f} s vs {ref:.6f} s collapsed "
              f"({m.iteration_time_s / ref - 1:+.2e})")
    return out[0][0], out[1][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-full", action="store_true",
                    help="skip the every-replica oracle run (tens of seconds)")
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    model, cluster = load_model("gpt3-13b"), load_cluster("scale-1024")

    long_plan = uniform_plan(model, cluster, pp=16, micro_batch=1, global_batch=256)
    cost = CostModel(model, cluster)
    actions = simulate(long_plan, cost).metrics.extra["simulated_actions"]
    no_trace = SimOptions(trace=False)
    simpy_rate, e2e_s, lean_s, run_s = 0.0, float("inf"), float("inf"), float("inf")
    for _ in range(reps):               # interleaved, so that all see the same load
        simpy_rate = max(simpy_rate, simpy_events_per_s(200_000))
        e2e_s = min(e2e_s, best(lambda: simulate(long_plan, cost), 1))
        lean_s = min(lean_s, best(lambda: simulate(long_plan, cost, no_trace), 1))
        run_s = min(run_s, engine_run_s(long_plan, cost))
    print(f"raw SimPy timeouts:                   {simpy_rate:10,.0f} events/s")
    for what, secs in (("simulate, with the trace (default)", e2e_s),
                       ("simulate, trace=False (the search)", lean_s),
                       ("event run alone (SimPy phase)", run_s)):
        rate = actions / secs
        print(f"{what:37s} {rate:10,.0f} actions/s ({actions} actions in "
              f"{secs * 1e3:.1f} ms; ratio {rate / simpy_rate:.2f})")
    actions_per_s = actions / run_s

    big = uniform_plan(model, cluster, pp=16, dp=64, micro_batch=1, global_batch=64 * 64)
    cold_s = best(lambda: simulate(big, CostModel(model, cluster)), reps)
    warm_cost = CostModel(model, cluster)
    result = simulate(big, warm_cost)
    warm_s = best(lambda: simulate(big, warm_cost), reps)
    m = result.metrics
    print(f"1024-GPU plan (PP16 x DP64, 64 micro-batches, 1F1B, gpt3-13b): "
          f"{cold_s:.3f} s cold, {warm_s:.3f} s warm; simulated iteration "
          f"{m.iteration_time_s:.3f} s, MFU {m.mfu:.1%}, {len(m.oom)} devices over memory, "
          f"{m.extra['simulated_actions']} actions simulated for {len(big.devices)} devices")

    plans = [uniform_plan(model, cluster, pp=pp, dp=1024 // pp, micro_batch=b,
                          global_batch=(1024 // pp) * b * 64, schedule=kind,
                          chunks=2 if kind == "interleaved-1f1b" else 1)
             for pp in (4, 8, 16) for b in (1, 2)
             for kind in ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b")]
    sweep_cost = CostModel(model, cluster)
    cache = AnalyticCache()
    for plan in plans:                  # the search's steady state: cost model and cache warm
        estimate(plan, sweep_cost, cache=cache)
    # Each plan's best of `reps` runs, averaged over the plans (load spikes filtered).
    per_plan = sum(best(lambda p=p: estimate(p, sweep_cost, cache=cache), 3 * reps)
                   for p in plans) / len(plans)
    uncached = sum(best(lambda p=p: estimate(p, sweep_cost), reps) for p in plans) / len(plans)
    est = estimate(big, sweep_cost, cache=cache).iteration_time_s
    print(f"analytic tier: {per_plan * 1e3:.3f} ms per 1024-GPU plan with the search's "
          f"cache, {uncached * 1e3:.3f} ms without ({len(plans)} plans); its iteration "
          f"for the plan above {est:.3f} s ({est / m.iteration_time_s - 1:+.1%} vs simulated)")
    asym_s, asym16k_s = asym_figures(reps, not args.no_full)
    gap = sharded_short_list_gap()
    print(f"actions_per_s={actions_per_s:.0f} simpy_events_per_s={simpy_rate:.0f} "
          f"ratio={actions_per_s / simpy_rate:.3f} sim_1024gpu_s={cold_s:.3f} "
          f"analytic_per_plan_s={per_plan:.6f} sim_1024gpu_asym_s={asym_s:.3f} "
          f"sim_16k_asym_s={asym16k_s:.3f} zero_cp_max_gap={gap:.4f}")


# The searches whose short lists hold ZeRO and cp plans (Llama 3 8B on two 8x H100
# nodes; target: the analytic tier within 5% of the simulator on every ranked plan).
SHARDED_SEARCHES = (
    ({"preset": "llama3-8b", "seq_len": 131072}, {"tp": 8, "pp": 1}),   # picks cp 2
    ({"preset": "llama3-8b", "n_layer": 8, "seq_len": 16384}, {"tp": 4, "cp": 2, "zero": 3}),
    ({"preset": "llama3-8b", "n_layer": 8, "seq_len": 16384}, {"tp": 4, "cp": 2, "zero": 2}),
)


def sharded_short_list_gap() -> float:
    """The largest |analytic / simulator - 1| of iteration time over the ranked plans of
    `SHARDED_SEARCHES`, each search's printed."""
    from hyperpipe.search.search import SearchConstraints, search
    doc = {"name": "h100x2", "inter_node": {"bandwidth": "400 Gbit/s", "latency": "5 us"},
           "nodes": [{"name": f"n{i}", "device": "H100-SXM", "count": 8,
                      "nics": {"count": 8, "bandwidth": "400 Gbit/s"}} for i in range(2)]}
    cluster = cluster_from_dict(doc, where="bench", name=doc["name"])
    worst = 0.0
    for model_doc, fixed in SHARDED_SEARCHES:
        model = load_model(model_doc)
        result = search(model, cluster, SearchConstraints(global_batch=4, micro_batch=1,
                                                          **fixed), top=5, quiet=True)
        cost = CostModel(model, cluster)
        gaps = [abs(estimate(c.plan, cost).iteration_time_s / c.metrics.iteration_time_s
                    - 1) for c in result.ranked]
        kinds = sorted({(c.plan.zero, st.cp) for c in result.ranked
                        for p in c.plan.pipelines for st in p.stages})
        print(f"analytic vs simulator, short list of {model.name} s={model.seq_len} "
              f"{fixed}: {len(gaps)} plans, (zero, cp) {kinds}, max gap {max(gaps):.4f}")
        worst = max(worst, *gaps)
    return worst


if __name__ == "__main__":
    main()
