"""A large what-if sweep on both backends: local processes and Ray, on this machine.

The sweep: a synthetic 8-layer model (1e10 FLOPs per layer and sample, 1 MB of
activations per sample) on a two-node cluster (2 "fast" + 2 "slow" devices), 20
inter-node bandwidths x 10 peak speeds of the slow type = 200 cluster variants, each
searched in full (`hyperpipe.whatif.sweep.whatif`). The local backend maps the
variants over a pool of `--workers` processes; the Ray backend over a Ray started here
with as many CPUs (its start-up included in `ray_s`, and printed apart). Both must
give the same rows (every variant's best plan and metrics), which is checked.

Prints the tables' agreement and, last, ``variants=N local_s=A ray_s=B``.

Run: python experiments/sweep_scale.py [--workers 2] [--variants-per-axis 20 10]
(needs `pip install -e '.[ray]'`).
"""

from __future__ import annotations

import argparse
import time

from hyperpipe.cluster.cluster import load_cluster
from hyperpipe.models import load_model
from hyperpipe.search.backends import LocalBackend, RayBackend, import_ray
from hyperpipe.whatif.sweep import Planning, SweepOptions, format_whatif, whatif

CLUSTER = {"name": "sweep-two-nodes",
           "device_types": {
               "fast": {"peak_flops": "2 TFLOP/s", "efficiency": 1.0, "memory": "100 GB",
                        "mem_bandwidth": "1e15 B/s"},
               "slow": {"peak_flops": "1 TFLOP/s", "efficiency": 1.0, "memory": "100 GB",
                        "mem_bandwidth": "1e15 B/s"}},
           "nodes": [{"name": "a", "device": "fast", "count": 2},
                     {"name": "b", "device": "slow", "count": 2}],
           "inter_node": {"bandwidth": "100 Gbit/s", "latency": "5 us"}}
MODEL = {"kind": "synthetic", "name": "sweep", "layers": 8, "seq_len": 1,
         "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
         "params_per_layer": 1000}


def vary(n_bw: int, n_speed: int) -> list[str]:
    bws = ",".join(f"{0.5 * 2 ** (i / 2):.4g} Gbit/s" for i in range(n_bw))
    speeds = ",".join(f"{0.25 + 0.25 * i:g} TFLOP/s" for i in range(n_speed))
    return [f"inter_node.bandwidth={bws}", f"device_types.slow.peak_flops={speeds}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="processes / Ray CPUs")
    ap.add_argument("--variants-per-axis", type=int, nargs=2, default=(20, 10),
                    metavar=("BANDWIDTHS", "SPEEDS"))
    args = ap.parse_args()
    import_ray()
    axes = vary(*args.variants_per_axis)
    model, cluster = load_model(MODEL), load_cluster(CLUSTER)
    sweep = SweepOptions(Planning(global_batch=8, micro_batch=1), vary=tuple(axes))

    t = time.perf_counter()
    with LocalBackend(args.workers) as backend:
        local = whatif(model, cluster, sweep, backend=backend)
    local_s = time.perf_counter() - t

    t = time.perf_counter()
    with RayBackend(num_cpus=args.workers) as backend:
        start_s = time.perf_counter() - t
        remote = whatif(model, cluster, sweep, backend=backend)
    ray_s = time.perf_counter() - t

    n = len(local.rows)
    same = local.to_dict() == remote.to_dict()
    print(f"{n} cluster variants, each a full search; {args.workers} local processes vs a "
          f"local Ray of {args.workers} CPUs (start-up {start_s:.1f} s, included)")
    print(f"identical rows on both backends: {same}; identical tables: "
          f"{format_whatif(local) == format_whatif(remote)}")
    print(f"variants={n} local_s={local_s:.2f} ray_s={ray_s:.2f}")
    if not same:
        raise SystemExit("the backends disagree")


if __name__ == "__main__":
    main()
