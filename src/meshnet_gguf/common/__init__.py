"""Small pieces every area uses: settings (`NodeSettings`), logging, byte units, loopback ports,
backoff, and the one way a file is written whole.

May import: nothing else of the package.
"""
