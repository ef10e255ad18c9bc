"""Operations: systemd (notify, the unit file, the node part), the state dir's lock,
Prometheus metrics, and the relay tunnel's health.

May import: every area but prepare, doctor, node, cli, devtools and reference.
"""
