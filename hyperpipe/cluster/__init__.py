"""Hardware: the device catalog (peak FLOP/s, memory, bandwidths, efficiencies, each
figure with its source) and clusters (nodes of devices, intra-node ports and NICs as
hops, routes between devices, prices) with their loader. Nothing here knows about
layers or costs.
"""
