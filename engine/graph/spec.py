"""The node declaration contract: what a node type says about itself.

A node type is a small class with typed inputs (widgets or links), typed outputs, a category and one
function, `run`. The engine's validation and executor read only this contract; `nodes/` declares the
concrete types and keeps the registry. Nothing here imports Qt.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Widget kinds: inputs of these kinds are edited in place and stored as widget values.
INT = "INT"
FLOAT = "FLOAT"
STRING = "STRING"
BOOLEAN = "BOOLEAN"
COMBO = "COMBO"
SEED = "SEED"
WIDGET_KINDS = frozenset({INT, FLOAT, STRING, BOOLEAN, COMBO, SEED})

# A link of type "*" accepts any type (used by test and utility nodes).
ANY = "*"

SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF
SEED_CONTROLS = ("fixed", "increment", "decrement", "randomize")
DEFAULT_SEED_CONTROL = "randomize"  # a new seed widget's control, as ComfyUI's (a missing entry means fixed)


@dataclass(frozen=True)
class Input:
    """One input of a node type: a widget (INT, FLOAT, ...) or a link of a data type (MODEL, LATENT, ...)."""

    name: str
    kind: str  # a widget kind from WIDGET_KINDS, or a link type name such as "MODEL"
    default: Any = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    multiline: bool = False  # STRING only
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None  # COMBO; callables run at run time
    optional: bool = False  # a link input that may stay unconnected
    description: str = ""
    check: Callable[[Any], str | None] | None = None  # a further check of a widget value of the right type:
    # a message saying what is wrong with it and what is accepted, or None (e.g. SaveImage's prefix)

    @property
    def is_widget(self) -> bool:
        return self.kind in WIDGET_KINDS

    @property
    def link_type(self) -> str:
        """The type a link into this input must carry (widgets of INT/FLOAT/STRING... may be linked too)."""
        return INT if self.kind == SEED else self.kind

    def current_choices(self) -> list[str]:
        if self.choices is None:
            return []
        return list(self.choices() if callable(self.choices) else self.choices)

    def check_value(self, value: Any) -> str | None:
        """None when `value` suits this widget, else a message naming the value and what is accepted."""
        kind = self.kind
        if kind in (INT, SEED):
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{self.name}: expected an integer, got {value!r}"
        elif kind == FLOAT:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{self.name}: expected a number, got {value!r}"
            if isinstance(value, float) and not math.isfinite(value):
                return f"{self.name}: {value!r} is not a finite number"
        elif kind == STRING:
            if not isinstance(value, str):
                return f"{self.name}: expected a string, got {value!r}"
        elif kind == BOOLEAN:
            if not isinstance(value, bool):
                return f"{self.name}: expected true or false, got {value!r}"
        elif kind == COMBO:
            choices = self.current_choices()
            if value not in choices:
                shown = ", ".join(choices[:20]) + (", ..." if len(choices) > 20 else "")
                return f"{self.name}: {value!r} is not one of the choices ({shown or 'none available'})"
            return None
        low = 0 if kind == SEED else self.min
        high = SEED_MAX if kind == SEED else self.max
        if kind in (INT, FLOAT, SEED):
            if low is not None and value < low:
                return f"{self.name}: {value!r} is below the minimum {low}"
            if high is not None and value > high:
                return f"{self.name}: {value!r} is above the maximum {high}"
        if self.check is not None:
            problem = self.check(value)
            return None if problem is None else f"{self.name}: {problem}"
        return None


def int_input(name: str, default: int, min: int | None = None, max: int | None = None, step: int = 1,
              description: str = "") -> Input:
    return Input(name, INT, default, min, max, step, description=description)


def float_input(name: str, default: float, min: float | None = None, max: float | None = None,
                step: float = 0.01, description: str = "") -> Input:
    return Input(name, FLOAT, float(default), min, max, step, description=description)


def string_input(name: str, default: str = "", multiline: bool = False, description: str = "",
                 check: Callable[[Any], str | None] | None = None) -> Input:
    return Input(name, STRING, default, multiline=multiline, description=description, check=check)


def bool_input(name: str, default: bool, description: str = "") -> Input:
    return Input(name, BOOLEAN, default, description=description)


def combo_input(name: str, choices: Sequence[str] | Callable[[], Sequence[str]], default: str | None = None,
                description: str = "") -> Input:
    if default is None and not callable(choices):
        default = choices[0] if choices else ""
    return Input(name, COMBO, default, choices=choices if callable(choices) else tuple(choices),
                 description=description)


def seed_input(name: str = "seed", default: int = 0, description: str = "") -> Input:
    """A seed with "control after generate" (fixed, increment, decrement, randomize)."""
    return Input(name, SEED, default, 0, SEED_MAX, 1, description=description)


def link_input(name: str, type_name: str, optional: bool = False, description: str = "") -> Input:
    return Input(name, type_name, optional=optional, description=description)


def next_seed(seed: int, control: str, rng: random.Random | None = None) -> int:
    """The seed a SEED widget holds after a run, under its control-after-generate mode."""
    if control == "fixed":
        return seed
    if control == "increment":
        return (seed + 1) % (SEED_MAX + 1)
    if control == "decrement":
        return (seed - 1) % (SEED_MAX + 1)
    if control == "randomize":
        return (rng or random).randint(0, SEED_MAX)
    raise ValueError(f"unknown control_after_generate {control!r}; accepted: {', '.join(SEED_CONTROLS)}")


@dataclass(frozen=True)
class Output:
    name: str
    type: str
    description: str = ""


@dataclass
class RunContext:
    """What a running node may use besides its inputs. The executor fills it per node."""

    node_id: str
    check_interrupt: Callable[[], None] = lambda: None  # raises Interrupted when the job was interrupted
    report_progress: Callable[[int, int], None] = lambda value, maximum: None
    report_preview: Callable[[Any], None] = lambda image: None  # a PIL image or HxWx3 uint8 array
    settings: Any = None  # engine.settings.Settings (paths of the models and output folders)
    workflow: Any = None  # the workflow document being run (SaveImage embeds it in PNGs)
    lookup: Callable[[str], Any] | None = None  # the registry's type lookup (ComfyUI's formats in PNGs)
    extra: dict[str, Any] = field(default_factory=dict)


class NodeType:
    """Base of every node type. Subclasses set the class attributes and implement `run`.

    `run(ctx, **inputs)` receives one keyword argument per input (widget values and linked values;
    an unconnected optional input is None) and returns a tuple with one value per output.
    """

    type_name: ClassVar[str] = ""  # defaults to the class name
    display_name: ClassVar[str] = ""
    category: ClassVar[str] = "utils"
    description: ClassVar[str] = ""
    inputs: ClassVar[tuple[Input, ...]] = ()
    outputs: ClassVar[tuple[Output, ...]] = ()
    output_node: ClassVar[bool] = False
    # Model-bearing loaders declare which memory-runtime module they load (e.g. "diffusion", "te", "vae").
    memory_module: ClassVar[str | None] = None
    # Widgets whose value names a file in the input folder (LoadImage's image): a job sent to a cluster
    # worker carries those files, since the worker's input folder is its own (engine/cluster/inputs.py).
    input_files: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("type_name"):
            cls.type_name = cls.__name__
        if not cls.__dict__.get("display_name"):
            cls.display_name = cls.type_name

    @classmethod
    def input_named(cls, name: str) -> Input | None:
        return next((i for i in cls.inputs if i.name == name), None)

    @classmethod
    def widget_inputs(cls) -> tuple[Input, ...]:
        return tuple(i for i in cls.inputs if i.is_widget)

    @classmethod
    def default_widget_values(cls) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for i in cls.widget_inputs():
            default = i.default
            if i.kind == COMBO and default is None:
                choices = i.current_choices()
                default = choices[0] if choices else ""
            values[i.name] = default
        return values

    @classmethod
    def fingerprint(cls, settings: Any, **widgets: Any) -> Any:
        """Something that changes when the node's result would change for the same widget values, e.g. the
        modification time of the file a loader reads (ComfyUI's IS_CHANGED). Part of the cache signature."""
        return None

    def run(self, ctx: RunContext, **inputs: Any) -> tuple:
        raise NotImplementedError(f"node type {self.type_name} has no run()")
