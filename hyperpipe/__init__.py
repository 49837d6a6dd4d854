"""HyperPipe: plan, simulate and run pipeline-parallel training on heterogeneous GPUs.

The packages, lowest first, each importing only those before it: `core`, `models`,
`cluster`, `plan`, `sim`, `synth`, `search`, `whatif`, `frameworks`, `exec`, `cli`
(docs/architecture.md has the table and the data flow).
"""

__version__ = "0.1.0"
