"""Small pieces every area uses: settings (`NodeSettings`), logging, byte units, loopback ports,
backoff, the one way a file is written whole, and the one thread a database's blocking calls run on.

May import: nothing else of the package.
"""
