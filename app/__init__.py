"""Sluice desktop app (PySide6) and command line."""
