"""Doctor: whether this box can serve, and how to fix what stops it, with nothing downloaded or written.

Preparation is checked by running it with its "may not download or write" flag down
(`prepare.pipeline.model_size`), beside what preparation does not look at: the tracker's
clock and key, the public port, the relay. It stands above `prepare`, `mesh` and `ops`
because it checks all three; none of them imports it.

May import: common, contract, models, llama, hardware, prepare, mesh.
"""
