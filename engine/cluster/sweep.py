"""Sweeps: `NODE_ID.INPUT=VALUES` where VALUES is `A..B` (integers, both ends included), `@FILE` (one value a
non-empty line) or `a,b,c`; the grid is the product of all sweeps, the first sweep varying slowest."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from engine.cluster import ClusterError

_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")
MAX_GRID = 10_000_000  # a grid larger than this is a typo (e.g. 1..10000000000), not a job list


@dataclass(frozen=True)
class Sweep:
    key: str  # "NODE_ID.INPUT", as `--set` takes it
    values: tuple[str, ...]  # value texts, converted as `--set` values are


def parse_sweep(text: str, base: Path | None = None) -> Sweep:
    """`6.seed=1..1000`, `3.text=@prompts.txt` (relative to `base`, default the current folder) or
    `6.cfg=4,6`; ClusterError names a bad one."""
    key, equals, spec = text.partition("=")
    node_id, dot, name = key.partition(".")
    if not equals or not dot or not node_id or not name or not spec:
        raise ClusterError(f"--sweep {text!r}: expected NODE_ID.INPUT=A..B, NODE_ID.INPUT=@FILE or "
                           f"NODE_ID.INPUT=a,b,c (e.g. --sweep 6.seed=1..100)")
    if (match := _RANGE.match(spec)) is not None:
        first, last = int(match.group(1)), int(match.group(2))
        if last < first:
            raise ClusterError(f"--sweep {text!r}: the range {first}..{last} is empty; expected A..B with "
                               f"A <= B")
        if last - first + 1 > MAX_GRID:
            raise ClusterError(f"--sweep {text!r}: {last - first + 1} values; at most {MAX_GRID} are "
                               f"accepted")
        return Sweep(key, tuple(str(value) for value in range(first, last + 1)))
    if spec.startswith("@"):
        path = (base or Path.cwd()) / Path(spec[1:]).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ClusterError(f"--sweep {text!r}: cannot read {path}: {error}") from None
        values = tuple(line for line in lines if line.strip())
        if not values:
            raise ClusterError(f"--sweep {text!r}: {path} has no non-empty line; expected one value a line")
        return Sweep(key, values)
    return Sweep(key, tuple(part for part in spec.split(",")))


def grid(sweeps: list[Sweep]) -> list[list[str]]:
    """Every combination as `--set` texts (`["6.seed=1", "3.text=a fox"]`), the last sweep varying fastest."""
    size = 1
    for sweep in sweeps:
        size *= len(sweep.values)
    if size > MAX_GRID:
        raise ClusterError(f"the sweeps make {size} jobs; at most {MAX_GRID} are accepted")
    keys = [sweep.key for sweep in sweeps]
    return [[f"{key}={value}" for key, value in zip(keys, combination, strict=True)]
            for combination in itertools.product(*(sweep.values for sweep in sweeps))]
