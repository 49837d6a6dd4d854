"""Translation between plans and other frameworks' configurations: a plan exported to
what torchtitan, Megatron-LM or DeepSpeed needs to run its partition, with what that
framework cannot express. It sits above the planning packages so that reading a
framework's configuration into a plan may use any of them.
"""
