"""The keyboard shortcuts, listed once for the menus and for Help > Shortcuts."""

from __future__ import annotations

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

SHORTCUTS: list[tuple[str, str]] = [
    ("Ctrl+Enter", "Queue the workflow (validates first)"),
    ("Esc", "Interrupt the running job"),
    ("Tab / double-click", "Search nodes to add"),
    ("Ctrl+Z / Ctrl+Shift+Z", "Undo / redo"),
    ("Ctrl+C / Ctrl+V", "Copy / paste nodes (as workflow JSON)"),
    ("Ctrl+D", "Duplicate the selection"),
    ("Delete", "Delete the selection"),
    ("Ctrl+M", "Mute / unmute the selected nodes"),
    ("Ctrl+B", "Bypass / restore the selected nodes"),
    ("Alt+C", "Collapse / expand the selected nodes"),
    ("Ctrl+G", "Group the selected nodes"),
    ("F / Home", "Fit the graph in the view"),
    ("Wheel", "Zoom around the cursor"),
    ("Middle drag / Space+drag", "Pan"),
    ("Ctrl+N / Ctrl+O / Ctrl+S", "New / open / save"),
    ("Ctrl+Shift+S", "Save as"),
]


class ShortcutsDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Keyboard shortcuts")
        table = QTableWidget(len(SHORTCUTS), 2)
        table.setHorizontalHeaderLabels(["Keys", "Action"])
        table.verticalHeader().setVisible(False)
        for row, (keys, action) in enumerate(SHORTCUTS):
            table.setItem(row, 0, QTableWidgetItem(keys))
            table.setItem(row, 1, QTableWidgetItem(action))
        table.resizeColumnsToContents()
        table.horizontalHeader().setStretchLastSection(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(table)
        layout.addWidget(buttons)
        self.resize(520, 480)
