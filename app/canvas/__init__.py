"""The node canvas: a QGraphicsScene that views a Workflow document, its items, view and undo commands."""
