"""What-if studies: a cluster or model parameter swept with the best plan per variant,
stragglers (today's plan kept against re-planning), added devices (a bigger variant is
never reported slower than one it contains), failures and goodput against the
checkpoint interval. Work runs on the search's local or Ray backend.
"""
