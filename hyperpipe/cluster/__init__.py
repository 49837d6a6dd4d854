"""Hardware: the device catalog and clusters. Nothing here knows about layers or costs.

* `catalog`: built-in device types (peak FLOP/s, memory, bandwidth, efficiency), each
  figure with its vendor source.
* `cluster`: nodes of devices, links inside and between nodes, routes between devices,
  prices; `load_cluster` (built-in name, file or dict) and `cluster_ref` (a plan's
  reference that round-trips through JSON).
"""
