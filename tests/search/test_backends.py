"""Backends: the local pool and Ray give the same results; without Ray installed,
`--backend ray` says how to install it (exit 2)."""

from __future__ import annotations

import json
import sys

import pytest

from hyperpipe.cli import main
from hyperpipe.core.errors import BadInput
from hyperpipe.search.backends import LocalBackend, RayBackend, make_backend
from hyperpipe.search.search import SearchConstraints, search
from hyperpipe.whatif.sweep import Planning, SweepOptions, whatif

CLUSTER = {"name": "two-nodes",
           "device_types": {
               "fast": {"peak_flops": "2 TFLOP/s", "efficiency": 1.0, "memory": "100 GB",
                        "mem_bandwidth": "1e15 B/s"},
               "slow": {"peak_flops": "1 TFLOP/s", "efficiency": 1.0, "memory": "100 GB",
                        "mem_bandwidth": "1e15 B/s"}},
           "nodes": [{"name": "a", "device": "fast", "count": 2},
                     {"name": "b", "device": "slow", "count": 2}],
           "inter_node": {"bandwidth": "10 Gbit/s", "latency": "5 us"}}
MODEL = {"kind": "synthetic", "name": "sweep", "layers": 8, "seq_len": 1,
         "fwd_flops_per_sample": 1.0e10, "activation_bytes_per_sample": 1.0e6,
         "params_per_layer": 1000}
VARY = ["inter_node.bandwidth=1 Gbit/s,100 Gbit/s", "nodes.a.slowdown=1.0,2.0"]


def _square(x: int) -> int:
    return x * x


def test_local_backend_keeps_order_with_and_without_a_pool():
    for workers in (1, 2):
        with LocalBackend(workers) as backend:
            assert backend.map(_square, range(7)) == [x * x for x in range(7)]
    with pytest.raises(BadInput, match="^workers: "):      # the CLI: --workers
        LocalBackend(0)
    # started now, collected later (the search runs its baselines so), in order
    from hyperpipe.search.backends import process_pool, start_map
    with process_pool(2) as pool, LocalBackend(2) as backend, LocalBackend(1) as here:
        for where in (pool, backend, here):
            wait = start_map(where, _square, range(7))
            assert wait() == [x * x for x in range(7)]
        assert backend.width == 2 and here.width == 1
    with pytest.raises(BadInput, match="^backend: "):      # the CLI: --backend
        make_backend("spark")


def _square_of_packed(args: tuple[str, int]) -> int:
    return args[1] * args[1]


def test_fan_out_gives_the_results_in_order_here_and_over_every_pool():
    """One helper spreads the search's work: here (no pool, or fewer items than
    `at_least`) or over a process pool or a backend, the same results in order."""
    from hyperpipe.search.backends import fan_out, process_pool
    here_calls: list[int] = []

    def here(x: int) -> int:
        here_calls.append(x)
        return x * x

    items = list(range(7))
    with process_pool(2) as pool, LocalBackend(2) as backend, LocalBackend(1) as one:
        for where in (None, pool, backend, one):
            wait = fan_out(where, items, here, _square_of_packed, lambda x: ("x", x))
            assert list(wait()) == [x * x for x in items]
        assert here_calls == items                  # only the pool-less run ran here
        wait = fan_out(pool, [3], here, _square_of_packed, lambda x: ("x", x), at_least=2)
        assert list(wait()) == [9] and here_calls == [*items, 3]


def test_backend_ray_without_ray_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError
    with pytest.raises(BadInput, match=r"pip install -e '\.\[ray\]'"):
        make_backend("ray")
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    for cmd in (["search"], ["whatif", "--vary", VARY[0]]):
        rc = main([*cmd, "--cluster", str(tmp_path / "c.json"), "--model", "tiny-gpt",
                   "--global-batch", "8", "--backend", "ray"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "pip install -e '.[ray]'" in err[0]


def _without_times(doc):
    if isinstance(doc, dict):
        return {k: _without_times(v) for k, v in doc.items() if k != "search_time_s"}
    if isinstance(doc, list):
        return [_without_times(v) for v in doc]
    return doc


@pytest.mark.slow
def test_ray_backend_gives_the_local_results():
    ray = pytest.importorskip("ray")      # CI installs it (.ci/run: '.[test,ray]')
    sweep = SweepOptions(Planning(global_batch=8, micro_batch=1, workers=2), vary=tuple(VARY))
    local = whatif(_spec(), _cluster(), sweep)
    c = SearchConstraints(global_batch=8)
    # over local workers, as over Ray's: a synthesis spread over workers may simulate
    # more orders than one in a single process (`synthesise_all`), so it counts more
    local_search = search(_spec(), _cluster(), c, top=3, workers=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RayBackend() as backend:         # uses the running Ray, leaves it running
            remote = whatif(_spec(), _cluster(), sweep, backend=backend)
            remote_search = search(_spec(), _cluster(), c, top=3, backend=backend)
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    assert remote.kind == "stragglers" and len(remote.rows) == 4
    assert _without_times(remote.to_dict()) == _without_times(local.to_dict())
    assert _without_times(remote_search.to_dict()) == _without_times(local_search.to_dict())


def _spec():
    from hyperpipe.models import load_model
    return load_model(MODEL)


def _cluster():
    from hyperpipe.cluster.cluster import load_cluster
    return load_cluster(CLUSTER)


def test_a_ray_address_where_nothing_listens_is_refused_at_once(capsys):
    """ray.init retried 127.0.0.1:1 for ever, deaf to Ctrl-C and SIGTERM."""
    import socket
    pytest.importorskip("ray")                 # the [ray] extra; CI installs it

    from hyperpipe.cli import main
    with socket.socket() as sock:                 # a free port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc = main(["whatif", "--cluster", "demo-hetero", "--model", "tiny-gpt",
               "--global-batch", "16", "--vary", "inter_node.bandwidth=1 Gbit/s",
               "--backend", "ray", "--ray-address", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--ray-address" in err[0]
