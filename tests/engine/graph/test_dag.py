"""The workflow graph's ancestors, topological order and cycles equal networkx's (the reference) on random
graphs, acyclic and cyclic."""

import random

import networkx as nx
import pytest

from engine.graph.dag import WorkflowGraph
from engine.graph.document import id_sort_key


def _random_graphs(seed: int, acyclic: bool) -> tuple[WorkflowGraph, nx.DiGraph]:
    rng = random.Random(seed)
    ids = [str(n) for n in rng.sample(range(1, 200), rng.randint(1, 30))]
    ours, theirs = WorkflowGraph(), nx.DiGraph()
    for node in ids:
        ours.add_node(node, None)
        theirs.add_node(node)
    for _ in range(rng.randint(0, 3 * len(ids))):
        a, b = rng.choice(ids), rng.choice(ids)
        if acyclic and ids.index(a) >= ids.index(b):
            continue
        ours.add_edge(a, b)
        theirs.add_edge(a, b)
    return ours, theirs


@pytest.mark.parametrize("seed", range(40))
def test_ancestors_and_order_by_id_equal_networkx_on_acyclic_graphs(seed):
    ours, theirs = _random_graphs(seed, acyclic=True)
    rng = random.Random(seed)
    for node in theirs:
        assert ours.ancestors(node) == nx.ancestors(theirs, node)
    subset = {n for n in theirs if rng.random() < 0.7}
    expected = list(nx.lexicographical_topological_sort(theirs.subgraph(subset), key=id_sort_key))
    assert ours.topological_order(subset, key=id_sort_key) == expected


@pytest.mark.parametrize("seed", range(40))
def test_cycles_are_one_per_cyclic_component_of_networkx_and_are_real_cycles(seed):
    ours, theirs = _random_graphs(seed, acyclic=False)
    components = [c for c in nx.strongly_connected_components(theirs)
                  if len(c) > 1 or theirs.has_edge(next(iter(c)), next(iter(c)))]
    cycles = ours.cycles(key=id_sort_key)
    assert sorted(min(c, key=id_sort_key) for c in components) == sorted(c[0] for c in cycles)
    for cycle in cycles:
        component = next(c for c in components if cycle[0] in c)
        assert cycle[0] == min(component, key=id_sort_key) and set(cycle) <= component
        assert all(theirs.has_edge(a, b) for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True))


def test_a_topological_order_of_a_cycle_names_its_nodes():
    graph = WorkflowGraph()
    for node in "abc":
        graph.add_node(node, None)
    graph.add_edge("a", "b")
    graph.add_edge("b", "a")
    with pytest.raises(ValueError, match=r"\['a', 'b'\] lie on a cycle"):
        graph.topological_order("abc", key=str)


def test_a_long_chain_needs_no_recursion():
    graph = WorkflowGraph()
    for index in range(20000):
        graph.add_node(str(index), None)
        if index:
            graph.add_edge(str(index - 1), str(index))
    graph.add_edge("19999", "0")
    (cycle,) = graph.cycles(key=int)
    assert len(cycle) == 20000 and cycle[0] == "0"
