"""Small pieces every area uses: settings (`NodeSettings`), logging, byte units, loopback ports,
backoff, the one way a file is written whole, the one thread a database's blocking calls run on,
and what the node's and the tracker's web pages share (`page_files`).

May import: nothing else of the package.
"""
