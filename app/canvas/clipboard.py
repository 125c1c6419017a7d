"""Copy and paste of canvas selections as workflow JSON text (so they travel between windows)."""

from __future__ import annotations

import copy

from PySide6.QtCore import QPointF

from app.canvas.commands import AddItemsCommand
from app.canvas.group_item import GroupItem
from app.canvas.scene import WorkflowScene
from engine.graph.document import Workflow


def selection_json(scene: WorkflowScene) -> str | None:
    """The selected nodes, the links among them and the selected groups as workflow JSON; None if empty."""
    node_ids = set(scene.selected_node_ids())
    group_ids = {item.group_id for item in scene.selectedItems() if isinstance(item, GroupItem)}
    if not node_ids and not group_ids:
        return None
    part = Workflow(
        nodes={i: copy.deepcopy(n) for i, n in scene.workflow.nodes.items() if i in node_ids},
        links=[copy.deepcopy(link) for link in scene.workflow.links
               if link.source in node_ids and link.target in node_ids],
        groups=[copy.deepcopy(g) for g in scene.workflow.groups if g.id in group_ids],
    )
    return part.dumps()


def paste_json(scene: WorkflowScene, text: str, at: QPointF) -> list[str]:
    """Add the nodes, links and groups of workflow JSON with fresh ids, their top-left corner at `at`.

    Raises WorkflowError when the text is not a workflow. Returns the new node ids (then selected).
    """
    part = Workflow.loads(text, source="the clipboard")
    corners = [n.pos for n in part.nodes.values()] + [g.rect[:2] for g in part.groups]
    if not corners:
        return []
    dx = at.x() - min(c[0] for c in corners)
    dy = at.y() - min(c[1] for c in corners)
    next_node = int(scene.workflow.new_node_id())
    id_map: dict[str, str] = {}
    nodes = []
    for node in part.nodes.values():
        id_map[node.id] = str(next_node)
        next_node += 1
        node.id = id_map[node.id]
        node.pos = (round(node.pos[0] + dx), round(node.pos[1] + dy))
        nodes.append(node)
    next_link = int(scene.workflow.new_link_id())
    links = []
    for link in part.links:
        link.id, link.source, link.target = str(next_link), id_map[link.source], id_map[link.target]
        next_link += 1
        links.append(link)
    next_group = int(scene.workflow.new_group_id())
    groups = []
    for group in part.groups:
        group.id = str(next_group)
        next_group += 1
        x, y, w, h = group.rect
        group.rect = (x + dx, y + dy, w, h)
        groups.append(group)
    scene.push(AddItemsCommand(scene, nodes, links, groups, text="Paste"))
    scene.clearSelection()
    for node in nodes:
        scene.node_items[node.id].setSelected(True)
    return [node.id for node in nodes]
