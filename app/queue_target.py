"""Where the desktop app's queue runs: on this machine (the default) or on a running `sluice serve` (or
ComfyUI) at a URL, kept in the settings file as `"queue": {"server": "http://HOST:PORT", "token": "..."}`.

Without a token in the file, the SLUICE_AUTH_TOKEN environment variable is sent, as `sluice run --server`
sends it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

QUEUE_KEY = "queue"  # the settings file's entry
TOKEN_ENV = "SLUICE_AUTH_TOKEN"  # app/server/main.py's


@dataclass(frozen=True)
class QueueTarget:
    server: str | None = None  # the server's URL as entered; None: this machine
    token: str | None = None  # the server's auth token as entered

    def describe(self) -> str:
        return f"the server at {self.server}" if self.server else "this machine"

    def sent_token(self) -> str | None:
        """The token requests carry: the entered one, else SLUICE_AUTH_TOKEN."""
        return self.token or os.environ.get(TOKEN_ENV) or None


def queue_target(settings: Any) -> QueueTarget:
    """The settings file's queue target (this machine when it names none)."""
    entry = settings.extra.get(QUEUE_KEY) if hasattr(settings, "extra") else None
    if not isinstance(entry, dict):
        return QueueTarget()
    server = str(entry.get("server") or "").strip() or None
    token = str(entry.get("token") or "").strip() or None
    return QueueTarget(server, token if server else None)


def set_queue_target(settings: Any, target: QueueTarget) -> None:
    """Keep `target` in `settings.extra` (written by save_settings); this machine leaves no entry."""
    if target.server is None:
        settings.extra.pop(QUEUE_KEY, None)
        return
    entry = {"server": target.server}
    if target.token:
        entry["token"] = target.token
    settings.extra[QUEUE_KEY] = entry
