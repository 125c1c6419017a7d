"""Sluice engine: everything that computes. Never imports Qt, nodes or app."""
