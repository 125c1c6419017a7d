"""Root conftest: makes `tools` importable in tests (the embedded model's data generator lives there)."""
