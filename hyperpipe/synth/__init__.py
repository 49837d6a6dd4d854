"""Schedules synthesised for one plan: per-rank orders by list scheduling, improved by
local moves, each candidate priced by the simulator (`hyperpipe.sim`).
"""
