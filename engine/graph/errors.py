"""The errors of the workflow runtime: bad documents, invalid graphs, interrupted jobs, failed nodes."""

from __future__ import annotations

from dataclasses import dataclass

VALIDATION_KINDS = ("unknown_type", "missing_input", "type_mismatch", "bad_value", "cycle", "no_output",
                    "bad_link", "too_large", "bad_setting")


class WorkflowError(ValueError):
    """A workflow file or document that cannot be read; the message names the bad id or JSON position."""


class Interrupted(Exception):
    """Raised inside a job (between nodes or by `ctx.check_interrupt()`) after `Executor.interrupt()`."""


@dataclass(frozen=True)
class ValidationError:
    """One problem of a workflow graph found before anything runs."""

    kind: str  # one of VALIDATION_KINDS
    message: str
    node_id: str | None = None
    input_name: str | None = None
    node_type: str | None = None

    def __str__(self) -> str:
        where = ""
        if self.node_id is not None:
            where = f"node {self.node_id}" + (f" ({self.node_type})" if self.node_type else "")
            if self.input_name is not None:
                where += f" input {self.input_name!r}"
            where += ": "
        return where + self.message


class NodeFailure(Exception):
    """A node's `run` raised; carries what the GUI and the CLI show about it."""

    def __init__(self, node_id: str, node_type: str, exception_type: str, message: str,
                 traceback: str) -> None:
        super().__init__(f"node {node_id} ({node_type}) failed: {exception_type}: {message}")
        self.node_id = node_id
        self.node_type = node_type
        self.exception_type = exception_type
        self.message = message
        self.traceback = traceback
