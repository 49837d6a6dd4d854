"""HyperPipe: plan, simulate and run pipeline-parallel training on heterogeneous GPUs."""

__version__ = "0.1.0"
