"""Serving a request: the public HTTP listener, the OpenAI proxy app, admission, request
validation, the stream meter and usage statistics.

May import: common, contract, llama (the upstream client). Never prepare, mesh, ops or cli.
"""
