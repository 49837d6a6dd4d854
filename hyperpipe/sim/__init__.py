"""Clusters, cost model, plans, schedules, the SimPy simulator, search and calibration."""
