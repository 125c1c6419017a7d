"""A test output node that keeps whatever reaches it, shared by the node tests."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.graph.spec import ANY, NodeType, RunContext, link_input


class Capture(NodeType):
    """Test output node: keeps whatever reaches it, by node id."""

    output_node = True
    inputs = (link_input("value", ANY),)
    seen: ClassVar[dict[str, Any]] = {}

    def run(self, ctx: RunContext, value: Any) -> tuple:
        Capture.seen[ctx.node_id] = value
        return ()
