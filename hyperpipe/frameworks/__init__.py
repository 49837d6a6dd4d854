"""Other frameworks' configurations: a plan exported to what torchtitan, Megatron-LM or
DeepSpeed needs to run its partition, with what that framework cannot express.
"""
