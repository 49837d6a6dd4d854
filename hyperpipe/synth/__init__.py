"""Schedules synthesised for one plan (kind synth): per-rank action orders built by list
scheduling from the plan's own stage and link times and memory, improved by local moves,
each candidate priced by the simulator (`hyperpipe.sim`). No search.
"""
