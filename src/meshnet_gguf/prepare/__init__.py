"""Preparing a launch, before any port opens: the pipeline (request, binary, hardware, quant,
model, facts, plan), the memory model, the quant advisor and the pure argv/env plan.

May import: common, contract, models, llama, hardware.
"""
