"""The bottom layer, with nothing about models, clusters or plans: the two error tiers
(`BadInput`, exit status 2; `InfeasiblePlan`, legal but does not fit), quantities with
units parsed once into SI numbers, the documented limits on user input, safe reading and
atomic writing of files with field checks, and progress bars on stderr.
"""
