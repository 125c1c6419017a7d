"""Sluice node types (declarative), their registry and user plugins. Never imports Qt."""
