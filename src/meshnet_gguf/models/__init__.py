"""Models on disk and on the hub: the curated catalog, model specs and their resolution, verified
resumable downloads, GGUF headers, GGUF names and quant selection, conversion, tiny test models.

May import: common, contract.
"""
