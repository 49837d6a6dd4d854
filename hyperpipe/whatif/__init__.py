"""What-if sweeps: variants of a cluster or model searched and compared, stragglers,
added devices, failures and goodput, run on the local or the Ray backend.
"""
