"""The link emulator's overhead and fidelity (exec.links, exec.fabric).

Threads of this process stand in for ranks; the emulator is its own process, as in a
run. Measures:

- round trip: a zero-byte flow posted and waited for (what every emulated message adds
  to a rank's time beyond its link time), median and 95th percentile, microseconds;
- lag: how late a rank holding a 10 MB flow over a 1 GB/s hop wakes after the arrival
  the emulator computed (its notice plus the sleep's own lateness), median and 95th
  percentile, microseconds;
- sharing: two such flows started together through the one hop, each against one alone
  (closed form: 2.0);
- the emulator process's CPU seconds per second of the runs above.

Last line ``round_trip_us=A round_trip_p95_us=B lag_us=C lag_p95_us=D share_ratio=E
emulator_cpu_per_s=F``. Oracles: the closed forms above (nothing here is fitted).

    python experiments/bench_links.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

from hyperpipe.exec import links
from hyperpipe.exec.fabric import Route, Topology

HOP_BYTES_PER_S = 1e9
FLOW_BYTES = 1e7           # 10 ms alone: the size of a typical emulated message


def _cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (Linux /proc), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    topo = Topology({"hop": HOP_BYTES_PER_S, "free": 1e30},
                    {(0, 1): Route(("hop",), 0.0), (2, 3): Route(("hop",), 0.0),
                     (1, 0): Route(("free",), 0.0)})
    emulator = links.start(topo)
    t_start = time.perf_counter()
    try:
        client = links.Links(emulator.address, emulator.authkey, 0, 30.0)
        trips = []
        for i in range(args.rounds):
            t0 = time.perf_counter()
            client.post(("trip", i), 1, 0, 0.0)
            client.deliver(("trip", i))
            trips.append(time.perf_counter() - t0)
        lags, alone = [], []
        for i in range(args.rounds // 4):
            t0 = time.perf_counter()
            client.post(("lag", i), 0, 1, FLOW_BYTES)
            arrival = client.arrival_s(("lag", i))
            woke = links.hold(arrival)
            lags.append(woke - arrival)
            alone.append(woke - t0)
        shared: list[float] = []

        def flow(key, src, dst):
            t0 = time.perf_counter()
            client.post(key, src, dst, FLOW_BYTES)
            shared.append(client.deliver(key) - t0)

        for i in range(args.rounds // 4):
            pair = [threading.Thread(target=flow, args=(("share", i, s), s, d))
                    for s, d in ((0, 1), (2, 3))]
            for t in pair:
                t.start()
            for t in pair:
                t.join()
        stats = client.stats()
        cpu = _cpu_s(emulator.process.pid)
        client.close()
    finally:
        wall = time.perf_counter() - t_start
        emulator.stop()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    ratio = statistics.median(shared) / statistics.median(alone)
    print(f"zero-byte round trip: median {statistics.median(trips) * 1e6:.1f} us, "
          f"p95 {pct(trips, 0.95) * 1e6:.1f} us ({len(trips)} flows)")
    print(f"10 MB over 1 GB/s alone: median {statistics.median(alone) * 1e3:.4f} ms "
          f"(closed form {FLOW_BYTES / HOP_BYTES_PER_S * 1e3:.4f} ms); wake-up lag after "
          f"the computed arrival: median {statistics.median(lags) * 1e6:.1f} us, p95 "
          f"{pct(lags, 0.95) * 1e6:.1f} us")
    print(f"two together: median {statistics.median(shared) * 1e3:.4f} ms, "
          f"{ratio:.4f}x one alone (closed form 2.0)")
    print(f"emulator: {stats.flows} flows, {stats.late_posts} posted after the model had "
          f"moved past their send time (largest lag {stats.max_late_s * 1e6:.0f} us); "
          f"{cpu:.2f} CPU s in {wall:.1f} s")
    print(f"round_trip_us={statistics.median(trips) * 1e6:.1f} "
          f"round_trip_p95_us={pct(trips, 0.95) * 1e6:.1f} "
          f"lag_us={statistics.median(lags) * 1e6:.1f} lag_p95_us={pct(lags, 0.95) * 1e6:.1f} "
          f"share_ratio={ratio:.4f} emulator_cpu_per_s={cpu / wall:.4f}")


if __name__ == "__main__":
    main()
