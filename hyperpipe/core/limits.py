"""The documented limits on everything a user can hand HyperPipe.

Every count, size and number that comes from a file or a flag is checked against one of
these bounds at the boundary (file loaders, the command line), so that a hostile or
careless input ends as one line on stderr and exit status 2, not a hang, a swap storm
or a traceback. The bounds are far above any real job (a 1024-GPU cluster, GPT-3 175B's
96 layers, a 4M-token global batch) and low enough that the work they allow finishes
in seconds to minutes and fits in a few GB.

The constants bound input files (bytes, values with YAML aliases expanded, nesting,
64-bit integers) and counts (devices, layers, batch, micro-batches, chunks, schedule
actions, workers, variants, steps, threads, seeds). A schedule over
`MAX_SCHEDULE_ACTIONS` is `InfeasiblePlan` (the search skips it, `hyperpipe schedule`
exits 2). Quantities have a finite range per dimension
(`hyperpipe.core.units.QUANTITY_RANGE`), so nothing computed from them overflows.
"""

from __future__ import annotations

MAX_JSON_BYTES = 16 * 2**20          # a plan of a 1024-GPU cluster is well under 1 MiB
MAX_YAML_BYTES = 2 * 2**20           # ~2 s to parse; clusters and models are a few kB
MAX_DOCUMENT_NODES = 2_000_000       # values in one document, aliases expanded
MAX_DOCUMENT_DEPTH = 64              # nesting levels of mappings and lists
MAX_INT = 2**63 - 1                  # integers in files: 64-bit signed
MAX_PATH_CHARS = 4096                # PATH_MAX on Linux

MAX_NODE_DEVICES = 1024              # devices of one node entry
MAX_NODE_REPEAT = 4096               # `repeat` of one node entry
MAX_CLUSTER_DEVICES = 65_536         # devices of a whole cluster
MAX_LAYERS = 10_000                  # layers of a model (GPT-3 175B has 96 blocks)
MAX_CUT_UNITS = MAX_LAYERS + 2       # layers a plan cuts: the blocks, embedding and head
MAX_MODEL_DIM = 2**24                # d_model, ffn_hidden, heads, vocab_size, seq_len
MAX_PARAMS_PER_LAYER = 10**13        # parameters of one synthetic layer
MAX_GLOBAL_BATCH = 65_536           # samples per iteration (GPT-3: 1536, Llama 3: 2048)
MAX_MICROBATCHES = 65_536            # micro-batches of one pipeline
MAX_PIPELINE_DEVICES = 4096          # devices (ranks) of one pipeline
MAX_CHUNKS = 64                      # stages per device (interleaved schedules)
MAX_CONTEXT_PARALLEL = 1024          # context ranks of one stage (Llama 3 405B: cp 16)
MAX_SCHEDULE_ACTIONS = 200_000       # devices x chunks x micro-batches x 3 of a schedule
MAX_DRAWN_ACTIONS = 4096             # actions of one schedule drawing (--format png:
MAX_DRAWN_RANKS = 256                # ranks of one; a bar takes ~7 ms, a rank 50 pixels)
MAX_WORKERS = 64                     # search / what-if worker processes
MAX_TOP = 1000                       # plans listed by search --top
MAX_VARIANTS = 4096                  # variants of one what-if sweep
# A search's tables hold a cost per range of layers [i, j) and a pipeline has at most
# `layers` stages: layers^2 x min(devices, layers) bounds its time and memory
# (`search.search_size`; 2,048 layers on 4 devices: about a minute and 1.4 GB; GPT-3
# 175B's 98 layers on any cluster of 98 devices or more: 0.94M).
MAX_SEARCH_SIZE = 2**24
MAX_STEPS = 1_000_000                # training steps of one run
MAX_THREADS = 256                    # CPU threads per rank
# The data stream seeds torch with seed * 2**24 + step (exec.data), which must fit the
# signed 64-bit value torch.manual_seed takes: 2**39 seeds, steps below 2**24.
MAX_SEED = 2**39 - 1
MAX_TIMEOUT_S = 86_400.0             # any wait of a run: one day
MAX_EMULATION_SCALE = 1000.0         # compute stretch of an emulated run
