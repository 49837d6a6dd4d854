"""Defaults of the training stack that the simulator and the executor share.

Both the simulated and the real data-parallel gradient reduction read their defaults
from here, so that a simulated plan and its real run bucket the gradients alike.
"""

from __future__ import annotations

# Bytes of gradient per data-parallel all-reduce bucket: PyTorch DDP's default
# (`DistributedDataParallel(bucket_cap_mb=25)`, torch/nn/parallel/distributed.py),
# which Megatron-LM's and torchtitan's DDP wrappers keep unless told otherwise.
DDP_BUCKET_BYTES = 25e6
