"""What this box has: CPU, RAM, GPUs and unified memory, read from sysfs/proc and probes.

May import: common, contract, models, llama (the binary lists its devices).
"""
