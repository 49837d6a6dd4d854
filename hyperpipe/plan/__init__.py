"""The formats the simulator and the executor share, and nothing that runs them.

* `plan`: a plan (replicas of pipelines, stages, devices, schedule kind) and its loader.
* `schedule`: the schedule IR (`Action` with its text form `2F0`), dependencies, validator.
* `generators`: one pure function per schedule kind, and the registry of kinds.
* `trace`: one record per executed action, for simulated and measured runs alike.
* `profile`: calibration profiles (measured numbers that override the cost model).
* `schedule_plot`: schedules drawn in unit time.
"""
