"""The workflow as a directed graph: its nodes, one edge per linked pair, and the three questions validation
and execution ask of it (what feeds a node, in which order to run nodes, where the cycles are).

A workflow has tens of nodes; plain dictionaries answer these in microseconds, where importing networkx
cost a first job about half a second on the H200's host (bench/e2e.py's cold SD1.5 profile). networkx
stays for ComfyUI's loop handling on import (comfy.py), which runs only when a file is opened.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from typing import Any

SortKey = Callable[[str], Any]


class WorkflowGraph:
    """Nodes in insertion order (each with the document's node as `doc`), edges from source to target."""

    def __init__(self) -> None:
        self.docs: dict[str, Any] = {}
        self._successors: dict[str, set[str]] = {}
        self._predecessors: dict[str, set[str]] = {}

    def add_node(self, node_id: str, doc: Any) -> None:
        self.docs[node_id] = doc
        self._successors.setdefault(node_id, set())
        self._predecessors.setdefault(node_id, set())

    def add_edge(self, source: str, target: str) -> None:
        """An edge between two nodes already added."""
        self._successors[source].add(target)
        self._predecessors[target].add(source)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.docs

    def __iter__(self) -> Iterator[str]:
        return iter(self.docs)

    def __len__(self) -> int:
        return len(self.docs)

    def has_edge(self, source: str, target: str) -> bool:
        return target in self._successors.get(source, ())

    def ancestors(self, node_id: str) -> set[str]:
        """Every node with a path to `node_id` (not the node itself, unless it lies on a cycle)."""
        found: set[str] = set()
        stack = list(self._predecessors[node_id])
        while stack:
            node = stack.pop()
            if node not in found:
                found.add(node)
                stack.extend(self._predecessors[node] - found)
        return found

    def topological_order(self, nodes: Iterable[str], key: SortKey) -> list[str]:
        """`nodes` in an order where every node follows the nodes of the set that feed it, ties broken by the
        smallest `key` first (networkx's lexicographical_topological_sort). Raises ValueError on a cycle."""
        chosen = set(nodes)
        waiting = {n: len(self._predecessors[n] & chosen) for n in chosen}
        ready = [(key(n), n) for n, count in waiting.items() if count == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, node = heapq.heappop(ready)
            order.append(node)
            for successor in self._successors[node] & chosen:
                waiting[successor] -= 1
                if waiting[successor] == 0:
                    heapq.heappush(ready, (key(successor), successor))
        if len(order) != len(chosen):
            raise ValueError(f"the nodes {sorted(chosen - set(order), key=key)} lie on a cycle")
        return order

    def cycles(self, key: SortKey) -> list[list[str]]:
        """One cycle per strongly connected component that has one (a self-loop counts), each as the node path
        from the component's smallest node by `key` back to just before it."""
        found = []
        for component in self._strongly_connected_components():
            first = min(component, key=key)
            if len(component) == 1 and not self.has_edge(first, first):
                continue
            found.append(self._cycle_through(first, component, key))
        return found

    def _strongly_connected_components(self) -> list[set[str]]:
        """Tarjan's algorithm, iterative (a long chain of nodes must not exhaust the recursion limit)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        components = []
        for root in self.docs:
            if root in index:
                continue
            work = [(root, iter(sorted(self._successors[root])))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                node, successors = work[-1]
                advanced = False
                for successor in successors:
                    if successor not in index:
                        index[successor] = low[successor] = len(index)
                        stack.append(successor)
                        on_stack.add(successor)
                        work.append((successor, iter(sorted(self._successors[successor]))))
                        advanced = True
                        break
                    if successor in on_stack:
                        low[node] = min(low[node], index[successor])
                if advanced:
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
        return components

    def _cycle_through(self, first: str, component: set[str], key: SortKey) -> list[str]:
        """A shortest path inside `component` from `first` back to it (breadth first, successors by key)."""
        came_from: dict[str, str] = {}
        frontier = [first]
        while frontier:
            following = []
            for node in frontier:
                for successor in sorted(self._successors[node] & component, key=key):
                    if successor == first:
                        path = [node]
                        while path[-1] != first:
                            path.append(came_from[path[-1]])
                        return path[::-1]
                    if successor not in came_from:
                        came_from[successor] = node
                        following.append(successor)
            frontier = following
        raise AssertionError(f"{first} lies on no cycle of its component")  # a component with a cycle has one
