"""A note on the canvas: the text of a ComfyUI Note or MarkdownNote node (kept in `workflow.meta["notes"]`, so
it is saved, exported back to ComfyUI and never run). Drag it to move it; double-click it to edit its text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QGraphicsItem, QGraphicsSceneMouseEvent

from app import theme
from engine.graph.comfy import NOTE_SIZE

if TYPE_CHECKING:
    from app.canvas.scene import WorkflowScene

TITLE_HEIGHT = 24.0
NOTE_BODY = QColor("#33302a")
NOTE_TITLE = QColor("#4a4434")


def note_id(note: dict[str, Any]) -> str:
    return str(note.get("id", ""))


def note_pos(note: dict[str, Any]) -> tuple[float, float]:
    """The note's canvas position; (0, 0) when the file holds none that reads as two numbers."""
    pos = note.get("pos")
    try:
        return float(pos[0]), float(pos[1])
    except (TypeError, ValueError, IndexError, KeyError):
        return 0.0, 0.0


class NoteItem(QGraphicsItem):
    """One entry of the document's notes list, drawn as a yellowish card with its text wrapped."""

    def __init__(self, workflow_scene: WorkflowScene, note: dict[str, Any]) -> None:
        super().__init__()
        self.workflow_scene = workflow_scene
        self.note = note
        self.setZValue(-5)  # above groups, below nodes
        self.setFlags(QGraphicsItem.GraphicsItemFlag.ItemIsMovable
                      | QGraphicsItem.GraphicsItemFlag.ItemIsSelectable)
        self.setPos(QPointF(*note_pos(note)))
        self.setToolTip("Note (double-click to edit)")

    @property
    def note_id(self) -> str:
        return note_id(self.note)

    def size(self) -> tuple[float, float]:
        size = self.note.get("size")
        try:
            return max(80.0, float(size[0])), max(TITLE_HEIGHT + 20, float(size[1]))
        except (TypeError, ValueError, IndexError, KeyError):
            return NOTE_SIZE

    def title(self) -> str:
        default = "Markdown note" if self.note.get("type") == "MarkdownNote" else "Note"
        return self.note.get("title") or default

    def boundingRect(self) -> QRectF:
        width, height = self.size()
        return QRectF(0, 0, width, height).adjusted(-2, -2, 2, 2)

    def paint(self, painter: QPainter, option: Any, widget: Any = None) -> None:
        width, height = self.size()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(theme.SELECTED if self.isSelected() else theme.NODE_BORDER, 1.5))
        painter.setBrush(NOTE_BODY)
        painter.drawRoundedRect(QRectF(0, 0, width, height), 6, 6)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(NOTE_TITLE)
        painter.drawRoundedRect(QRectF(0, 0, width, TITLE_HEIGHT), 6, 6)
        font = QFont(painter.font())
        font.setPointSizeF(9.5)
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(theme.TEXT)
        painter.drawText(QRectF(10, 0, width - 20, TITLE_HEIGHT),
                         Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, self.title())
        font.setBold(False)
        font.setPointSizeF(9.0)
        painter.setFont(font)
        text = str(self.note.get("text", ""))
        painter.setPen(theme.TEXT if text else theme.TEXT_DIM)
        painter.drawText(QRectF(10, TITLE_HEIGHT + 6, width - 20, height - TITLE_HEIGHT - 12),
                         Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap,
                         text or "(empty note: double-click to write)")

    def mouseDoubleClickEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        self.workflow_scene.request_note_edit(self.note_id)
        event.accept()
