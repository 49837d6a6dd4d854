"""Choosing a plan: the search space and its phases, baselines, reports, what-if sweeps.

* `space`: the declared search space (generators of valid factors).
* `templates`, `partition`: classes of identical pipelines, layers cut by dynamic
  programming.
* `search`: the phases from templates to the simulator-ranked short list.
* `evaluate`: judging candidates (analytic tier, simulator, ranking, Pareto front).
* `refine`: single-layer moves judged by the analytic tier or the simulator.
* `baselines`: uniform and proportional plans, tuned as a Megatron-LM user would.
* `report`: the text report of a search; `whatif`: sweeps over cluster/model variants.

Uses `sim` to judge plans; never imports the executor package.
"""
