"""The formats the simulator and the executor share, and nothing that runs them: plans
(replicas of pipelines, stages, devices, micro-batching, schedule kind) with their JSON
round trip, the schedule IR (per-device actions such as `2F0`) with its validator, the
schedule kinds and their generators, traces, calibration profiles, the training stack's
shared defaults, and schedule drawings.
"""
