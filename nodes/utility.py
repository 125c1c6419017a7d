"""Generic utility nodes: primitives that output their widget value, to feed one value to many inputs."""

from __future__ import annotations

from engine.graph.spec import (
    BOOLEAN,
    FLOAT,
    INT,
    STRING,
    NodeType,
    Output,
    RunContext,
    bool_input,
    float_input,
    int_input,
    string_input,
)


class PrimitiveInt(NodeType):
    display_name = "Integer"
    category = "utils/primitive"
    description = "Outputs its integer value (link it to several INT inputs to share one value)."
    inputs = (int_input("value", 0, min=-(2**63), max=2**63 - 1),)
    outputs = (Output("INT", INT),)

    def run(self, ctx: RunContext, value: int) -> tuple:
        return (value,)


class PrimitiveFloat(NodeType):
    display_name = "Float"
    category = "utils/primitive"
    description = "Outputs its number (link it to several FLOAT inputs to share one value)."
    inputs = (float_input("value", 0.0),)
    outputs = (Output("FLOAT", FLOAT),)

    def run(self, ctx: RunContext, value: float) -> tuple:
        return (float(value),)


class PrimitiveString(NodeType):
    display_name = "String"
    category = "utils/primitive"
    description = "Outputs its text (link it to several STRING inputs, e.g. one prompt for two samplers)."
    inputs = (string_input("value", "", multiline=True),)
    outputs = (Output("STRING", STRING),)

    def run(self, ctx: RunContext, value: str) -> tuple:
        return (value,)


class PrimitiveBoolean(NodeType):
    display_name = "Boolean"
    category = "utils/primitive"
    description = "Outputs its true/false value."
    inputs = (bool_input("value", False),)
    outputs = (Output("BOOLEAN", BOOLEAN),)

    def run(self, ctx: RunContext, value: bool) -> tuple:
        return (value,)


NODE_TYPES = (PrimitiveInt, PrimitiveFloat, PrimitiveString, PrimitiveBoolean)
