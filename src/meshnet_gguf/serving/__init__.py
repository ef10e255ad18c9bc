"""Serving a request: the public HTTP listener, its front door (`access`: who may call, each rule
once; the ASGI types are `common/asgi`), the OpenAI proxy app, the node's pages, admission
(`admission_modes`), the request slots (`slots`), request validation, the stream meter and usage
statistics.

May import: common, contract, llama (the upstream client). Never prepare, mesh, ops or cli.
"""
