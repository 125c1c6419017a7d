"""Root conftest: makes `tools` importable in tests (the embedded model's data generator lives there), and
holds fixtures that test folders share. The profile cache is off (SLUICE_CACHE=off, subprocesses included):
a test measures its own profiles, and nothing is written to ~/.cache; tests of the cache give it a folder."""

import os

import pytest
import torch

os.environ["SLUICE_CACHE"] = "off"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread; OpenMP barriers on a busy 2-core machine cost 10x more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
