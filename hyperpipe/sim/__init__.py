"""Predicting a plan: the cost model (compute of a layer's op on a device type, transfers
on a route, collectives, memory), the SimPy simulator (compute streams, links as shared
resources, collectives, memory over time with out-of-memory detection), the analytic
tier for pruning, calibration to measured traces, accuracy against real runs, the
metrics with their JSON keys, and timelines. No search; no torch process groups.
"""
