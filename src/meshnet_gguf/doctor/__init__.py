"""Doctor: whether this box can serve, and how to fix what stops it, with nothing downloaded or written.

Preparation is checked by running it with its "may not download or write" flag down
(`prepare.pipeline.model_size`), beside what preparation does not look at: the tracker's
clock and key, the public port, the relay. It stands above `prepare` and `mesh`, which it
checks, and beside `ops`: neither imports the other (the relay's metrics are ops', whether the
node can attach at its relay is doctor's).

May import: common, contract, models, llama, hardware, prepare, mesh.
"""
