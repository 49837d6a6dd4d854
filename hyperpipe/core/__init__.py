"""The bottom layer: what every other package builds on and nothing about models,
clusters or plans.

- `errors`: the two error tiers (`BadInput` and bugs; `InfeasiblePlan`, legal but does
  not fit) and `Stopped` for signals;
- `units`: quantities with units parsed once, at the file boundary, into SI numbers;
- `limits`: the documented bounds on every user-given size;
- `files`: reading files safely, writing them atomically, checking fields;
- `progress`: progress bars on stderr.
"""
