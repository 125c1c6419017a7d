"""The look of the app: a dark QPalette with a small style sheet, the colour of each data type, icons."""

from __future__ import annotations

import zlib

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPalette, QPen, QPixmap, QPolygonF
from PySide6.QtWidgets import QApplication

from engine.settings import resources_dir

# Fixed colours for the common ComfyUI types (the same hues users know), hashed hues for the others.
TYPE_COLORS = {
    "MODEL": "#b39ddb",
    "CLIP": "#ffd54f",
    "VAE": "#ff6e6e",
    "CONDITIONING": "#ffa931",
    "LATENT": "#ff9cf9",
    "IMAGE": "#64b5f6",
    "MASK": "#81c784",
    "NOISE": "#b0b0b0",
    "GUIDER": "#66ffff",
    "SAMPLER": "#ecb4b4",
    "SIGMAS": "#cdffcd",
    "INT": "#9fe3c9",
    "FLOAT": "#aee1a0",
    "STRING": "#c9d38c",
    "BOOLEAN": "#d0a5a5",
    "*": "#cfd4dc",
}

BACKGROUND = QColor("#17191c")
GRID_MINOR = QColor("#1e2024")
GRID_MAJOR = QColor("#25282d")
NODE_BODY = QColor("#2a2d33")
NODE_TITLE = QColor("#353a43")
NODE_BORDER = QColor("#0f1012")
SELECTED = QColor("#f0f0f0")
ERROR = QColor("#ff4d4d")
RUNNING = QColor("#4caf50")
BYPASSED = QColor("#9c4dcc")
TEXT = QColor("#dfe3ea")
TEXT_DIM = QColor("#8d94a0")
WIDGET_BG = QColor("#1d1f24")
WIDGET_FILL = QColor("#2f4b7c")
ACCENT = QColor("#4c8bf5")


def type_color(type_name: str) -> QColor:
    """The colour of a data type: fixed for the known ones, else a stable hue from the name's CRC32."""
    if type_name in TYPE_COLORS:
        return QColor(TYPE_COLORS[type_name])
    hue = zlib.crc32(type_name.encode()) % 360
    return QColor.fromHsv(hue, 120, 230)


def dark_palette() -> QPalette:
    palette = QPalette()
    roles = {
        QPalette.ColorRole.Window: "#202328",
        QPalette.ColorRole.WindowText: "#dfe3ea",
        QPalette.ColorRole.Base: "#191b1f",
        QPalette.ColorRole.AlternateBase: "#23262b",
        QPalette.ColorRole.ToolTipBase: "#2c3038",
        QPalette.ColorRole.ToolTipText: "#e8ebf0",
        QPalette.ColorRole.Text: "#dfe3ea",
        QPalette.ColorRole.Button: "#2c3038",
        QPalette.ColorRole.ButtonText: "#dfe3ea",
        QPalette.ColorRole.BrightText: "#ff6e6e",
        QPalette.ColorRole.Link: "#6ea8ff",
        QPalette.ColorRole.Highlight: "#2f5fb3",
        QPalette.ColorRole.HighlightedText: "#ffffff",
        QPalette.ColorRole.PlaceholderText: "#7b828e",
    }
    for role, color in roles.items():
        palette.setColor(role, QColor(color))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b717c"))
    return palette


def apply_dark_theme(app: QApplication) -> None:
    """Fusion style, the dark palette and resources/theme/dark.qss (when present)."""
    app.setStyle("Fusion")
    app.setPalette(dark_palette())
    sheet = resources_dir() / "theme" / "dark.qss"
    if sheet.is_file():
        app.setStyleSheet(sheet.read_text(encoding="utf-8"))


def _draw_icon(name: str, painter: QPainter) -> None:
    """Simple line icons on a 32x32 grid."""
    pen = QPen(QColor("#dfe3ea"), 2.4, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap,
               Qt.PenJoinStyle.RoundJoin)
    painter.setPen(pen)
    if name == "queue":
        painter.setBrush(QColor("#5cc06a"))
        painter.setPen(Qt.PenStyle.NoPen)
        painter.drawPolygon(QPolygonF([QPointF(10, 6), QPointF(26, 16), QPointF(10, 26)]))
    elif name == "interrupt":
        painter.setBrush(QColor("#ef5350"))
        painter.setPen(Qt.PenStyle.NoPen)
        painter.drawRoundedRect(QRectF(8, 8, 16, 16), 3, 3)
    elif name == "new":
        painter.drawPolyline(QPolygonF([QPointF(19, 5), QPointF(8, 5), QPointF(8, 27), QPointF(24, 27),
                                        QPointF(24, 10), QPointF(19, 5), QPointF(19, 10), QPointF(24, 10)]))
    elif name == "open":
        path = QPainterPath(QPointF(5, 25))
        for x, y in ((5, 8), (12, 8), (15, 11), (25, 11), (25, 14)):
            path.lineTo(x, y)
        path.moveTo(5, 25)
        path.lineTo(9, 15)
        path.lineTo(28, 15)
        path.lineTo(24, 25)
        path.closeSubpath()
        painter.drawPath(path)
    elif name == "save":
        painter.drawRoundedRect(QRectF(6, 6, 20, 20), 2, 2)
        painter.drawRect(QRectF(11, 6, 10, 7))
        painter.drawRect(QRectF(10, 18, 12, 8))
    elif name == "fit":
        for sx, sy in ((1, 1), (-1, 1), (1, -1), (-1, -1)):
            cx, cy = 16 - sx * 10, 16 - sy * 10
            painter.drawPolyline(QPolygonF([QPointF(cx, cy + sy * 6), QPointF(cx, cy),
                                            QPointF(cx + sx * 6, cy)]))
    elif name in ("undo", "redo"):
        flip = 1 if name == "redo" else -1
        path = QPainterPath(QPointF(16 - flip * 9, 22))
        path.cubicTo(QPointF(16 - flip * 9, 10), QPointF(16 + flip * 4, 8), QPointF(16 + flip * 9, 14))
        painter.drawPath(path)
        tip = QPointF(16 + flip * 9, 14)
        painter.drawPolyline(QPolygonF([tip + QPointF(-flip * 7, 1), tip, tip + QPointF(-flip * 1, -7)]))


def make_icon(name: str) -> QIcon:
    """An icon drawn at run time: queue, interrupt, new, open, save, fit, undo, redo."""
    pixmap = QPixmap(32, 32)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    _draw_icon(name, painter)
    painter.end()
    return QIcon(pixmap)
