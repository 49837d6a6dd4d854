"""Choosing a plan: the declared search space, pipeline templates and the layer partition,
the phased plan search judged by the analytic tier and the simulator, the tuned uniform
and proportional baselines and the Metis and AMP peer planners, the attribution of the
pick's gain and the report, and the backends that run independent work (local
processes or Ray). Never imports the executor.
"""
