"""PySide6 6.12.0 releases a slot's return value once too often on Python 3.11, so None (and True/False)
run out of references during a long session and the interpreter aborts (`none_dealloc`). pyproject pins
PySide6 below 6.12; this test fails if an installed PySide6 brings the bug back."""

import sys

from PySide6.QtCore import QObject, Signal, Slot


class Sender(QObject):
    fired = Signal(object)


class Receiver(QObject):
    def __init__(self):
        super().__init__()
        self.calls = 0

    @Slot(object)
    def on_fired(self, value):
        self.calls += 1  # returns None, like every slot of the app


def test_slot_calls_keep_the_reference_count_of_none(qapp):
    sender, receiver = Sender(), Receiver()
    sender.fired.connect(receiver.on_fired)
    before = sys.getrefcount(None)
    for _ in range(2000):
        sender.fired.emit(1)
    assert receiver.calls == 2000
    assert abs(sys.getrefcount(None) - before) < 50
