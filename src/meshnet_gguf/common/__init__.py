"""Small pieces every area uses: settings (`NodeSettings`), logging, byte units, loopback ports,
backoff, the one way a file is written whole, the one thread a database's blocking calls run on
(and the one way such a call is made on the event loop without waiting for a lock), and what the node's and the tracker's web pages share (`page_files`).

May import: nothing else of the package.
"""
