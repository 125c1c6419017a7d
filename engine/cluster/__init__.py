"""Scale out on Ray: one queue of generations over every worker (a GPU or a CPU core) of one or many machines.

- sweep.py: `--sweep NODE.INPUT=1..1000` / `=@lines.txt` / `=a,b,c` and the grid of overrides they make.
- worker.py: SluiceWorker, one Executor and memory runtime per Ray actor (its own process), models kept
  loaded between jobs; returns the saved images' bytes and names.
- scheduler.py: the driver's queue, placement by model, retries of jobs whose worker died, interrupt.
- output.py: writing returned images into the local output folder (never overwriting), with the overrides.

Ray is optional (`pip install 'sluice[cluster]'`): only scheduler.py imports it, and `require_ray` says how
to install it. Nothing here imports nodes/ or app/: the caller passes the node registry's factory.
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "install it with pip install 'sluice[cluster]'"


class ClusterError(Exception):
    """A cluster that cannot be used (Ray missing, no address, no workers); the message says what to do."""


def require_ray() -> Any:
    """The `ray` module, or ClusterError naming how to install it."""
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--ray needs Ray, which is not installed; {INSTALL_HINT}") from None
    return ray
