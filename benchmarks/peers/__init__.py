"""Peer tools measured against cpu-quant, each installed into its own environment."""
