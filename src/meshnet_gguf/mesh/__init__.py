"""The node's side of the Meshnet: its identity, route verification, the usage ledger and signed
receipts, the tracker client and the tracker link that runs them, and the relay link that reaches a tracker from behind NAT.

May import: common, contract, serving (the interfaces it plugs into).
"""
