"""Peer planners, re-implemented from their papers (the facts and formulas carry over; the
code is written here): each chooses a plan with its own search space and its own cost
model, over the same per-layer times (its "profiler" is our cost model's per-layer
figures); the chosen plans are then judged by our simulator like any other.

* `metis` - Metis (Um et al., USENIX ATC'24)
* `amp`   - AMP (Li et al., NeurIPS'22)

Why AMP as the second peer: it is the heterogeneity-aware planner closest to what a
Megatron user already runs (a rank-ordered device mesh over the whole cluster, one
(pp, tp, dp) for all stages) and its cost model is a closed form the paper writes out,
so it can be rebuilt faithfully; its search space (uneven layers by dynamic programming
over a fixed device order) differs from Metis's (device-group orders and per-stage tp),
so the two cover different ideas. FlashFlex/HexiScale need a graph partitioner and an
ILP of their own, and HAPT's schedule synthesis overlaps the schedules issue.
"""

from __future__ import annotations

from hyperpipe.search.peers.amp import amp_plan
from hyperpipe.search.peers.metis import metis_plan

PEERS = {"metis": metis_plan, "amp": amp_plan}
# What each peer may choose (the search's report and search_quality print it).
FREEDOMS = {
    "metis": "its own search (type order, tp per type, dp, micro-batch, layers by "
             "compute power, 1F1B or the generated kind the user fixed) and cost model, "
             "on every device of the hostfile it is given; given every subset of the "
             "device classes, its cost model picks",
    "amp": "its own search (pp, tp, dp, micro-batch over a rank-ordered mesh, layers by "
           "DP, 1F1B or the generated kind the user fixed) and cost model, on every "
           "device of the cluster it is given; given every subset of the device "
           "classes, its cost model picks",
}

__all__ = ["FREEDOMS", "PEERS", "amp_plan", "metis_plan"]
