"""Predicting a plan: the cost model, the SimPy simulator, the analytic tier, calibration.

* `costmodel`: time of a layer's op on a device type, of a transfer on a route.
* `simulator`: one training iteration event by event (`simulate`, `SimOptions`);
  `summary`: its text for people (`describe`).
* `program`: the per-rank programs, message boxes and all-reduce segments it runs.
* `network`: links as shared resources: flows over hops, rings for collectives.
* `memory`: memory over time and out-of-memory detection.
* `analytic`: closed forms and recurrences per plan, for pruning the search.
* `metrics`: the metrics of one iteration with DESIGN.md's JSON keys.
* `calibrate`: fitting the cost model to measured traces; `accuracy`: predicted
  against measured; `timeline`: drawings of traces.

Never imports the search or the executor packages.
"""
