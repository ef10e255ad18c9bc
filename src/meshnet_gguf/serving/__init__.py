"""Serving a request: the public HTTP listener, its front door (`asgi`: types, headers, answers and
errors; `access`: who may call, each rule once), the OpenAI proxy app, the node's pages, admission
(`admission_modes`), the request slots (`slots`), request validation, the stream meter and usage
statistics.

May import: common, contract, llama (the upstream client). Never prepare, mesh, ops or cli.
"""
