"""The prompt queue and the history, shared by the HTTP handlers (event loop thread) and the engine thread.

Prompts run in the order of their `number` (ComfyUI's: a counter, negative for `front`, so the queue is FIFO
and a front prompt goes before every queued one), ties in arrival order. The history keeps the latest
MAX_HISTORY finished prompts in the order they finished. Every change of the queue calls `on_change`
(the server broadcasts ComfyUI's `status` message from it). The engine thread runs one prompt at a time; Ray
workers (ray_backend.py) run several, so several can be running.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.graph.document import Workflow

MAX_HISTORY = 10000  # ComfyUI's MAXIMUM_HISTORY_SIZE


@dataclass
class QueueItem:
    number: float
    prompt_id: str
    prompt: dict[str, Any]  # the API prompt as the client sent it
    extra_data: dict[str, Any]  # ComfyUI's extra_data, with client_id
    outputs: list[str]  # the output nodes that run
    workflow: Workflow = field(repr=False)  # what the engine thread runs

    @property
    def client_id(self) -> str | None:
        client_id = self.extra_data.get("client_id")
        return client_id if isinstance(client_id, str) else None

    def as_list(self) -> list[Any]:
        """ComfyUI's queue entry: [number, prompt_id, prompt, extra_data, outputs_to_execute]."""
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


class PromptQueue:
    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._on_change = on_change
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, QueueItem]] = []
        self._arrival = itertools.count()
        self._running: dict[str, QueueItem] = {}  # prompt id -> item, in the order they started
        self._history: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._flags: dict[str, Any] = {}
        self._number = 0
        self._closed = False

    # -- the HTTP side --

    def next_number(self, front: bool) -> int:
        """ComfyUI's prompt number: the counter, negated for a prompt sent to the front."""
        with self._condition:
            number = self._number
            self._number += 1
            return -number if front else number

    def put(self, item: QueueItem) -> None:
        """Queue `item`; ValueError when its prompt id is already queued or running."""
        with self._condition:
            if self._known(item.prompt_id):
                raise ValueError(f"prompt id {item.prompt_id!r} is already queued or running")
            heapq.heappush(self._heap, (item.number, next(self._arrival), item))
            self._condition.notify_all()
        self._on_change()

    def _known(self, prompt_id: str) -> bool:
        return prompt_id in self._running or any(entry[2].prompt_id == prompt_id for entry in self._heap)

    def pending(self) -> list[QueueItem]:
        with self._condition:
            return [entry[2] for entry in sorted(self._heap)]

    def running(self) -> list[QueueItem]:
        with self._condition:
            return list(self._running.values())

    def remaining(self) -> int:
        """ComfyUI's queue_remaining: pending plus running prompts."""
        with self._condition:
            return len(self._heap) + len(self._running)

    def clear_pending(self) -> None:
        with self._condition:
            self._heap.clear()
        self._on_change()

    def delete_pending(self, prompt_ids: list[str]) -> None:
        with self._condition:
            self._heap = [entry for entry in self._heap if entry[2].prompt_id not in prompt_ids]
            heapq.heapify(self._heap)
        self._on_change()

    def history(self, max_items: int | None = None, offset: int = -1) -> dict[str, Any]:
        """ComfyUI's GET /history: from `offset` (the last `max_items` when offset < 0), at most max_items."""
        with self._condition:
            entries = list(self._history.items())
        if offset < 0:
            offset = max(0, len(entries) - max_items) if max_items is not None else 0
        chosen = entries[offset:] if max_items is None else entries[offset:offset + max_items]
        return dict(chosen)

    def history_item(self, prompt_id: str) -> dict[str, Any]:
        with self._condition:
            entry = self._history.get(prompt_id)
        return {} if entry is None else {prompt_id: entry}

    def clear_history(self) -> None:
        with self._condition:
            self._history.clear()

    def delete_history(self, prompt_ids: list[str]) -> None:
        with self._condition:
            for prompt_id in prompt_ids:
                self._history.pop(prompt_id, None)

    def set_flag(self, name: str, value: Any) -> None:
        with self._condition:
            self._flags[name] = value
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    # -- the engine thread's side --

    def take(self, timeout: float | None = None) -> QueueItem | None:
        """Wait (at most `timeout` s; None: for ever) for the next prompt (now running) or a flag; None when
        only flags are set, it is closed or the time ran out."""
        with self._condition:
            self._condition.wait_for(lambda: self._heap or self._flags or self._closed, timeout)
            if self._closed or not self._heap:
                return None
            item = heapq.heappop(self._heap)[2]
            self._running[item.prompt_id] = item
        self._on_change()
        return item

    @property
    def closed(self) -> bool:
        with self._condition:
            return self._closed

    def take_flags(self) -> dict[str, Any]:
        with self._condition:
            flags, self._flags = self._flags, {}
            return flags

    def finish(self, item: QueueItem, entry: dict[str, Any]) -> None:
        """Record a running prompt's history entry and mark it done."""
        with self._condition:
            self._history[item.prompt_id] = entry
            self._history.move_to_end(item.prompt_id)
            while len(self._history) > MAX_HISTORY:
                self._history.popitem(last=False)
            self._running.pop(item.prompt_id, None)
        self._on_change()
