"""A plain HTTP and websocket client for the server tests, used the way ComfyUI's
script_examples/websockets_api_example.py uses ComfyUI: queue a prompt with a client id, read the websocket
until `executing` with node null for that prompt, then read /history and /view."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engine.graph.comfy_export import to_api_prompt
from engine.graph.document import Workflow
from engine.settings import resources_dir


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def request(method: str, url: str, **options: Any) -> Reply:
    """One HTTP request (aiohttp's options: json=, data=, params=, headers=) on a fresh session."""

    async def send() -> Reply:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, **options) as answer:
                return Reply(answer.status, await answer.read(), dict(answer.headers))

    return asyncio.run(send())


@dataclass
class Followed:
    """What the websocket said about one prompt."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # JSON messages, in order
    frames: list[bytes] = field(default_factory=list)  # binary messages
    answer: dict[str, Any] = field(default_factory=dict)  # what POST /prompt answered

    def types(self) -> list[str]:
        return [message["type"] for message in self.messages]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [message["data"] for message in self.messages if message["type"] == kind]


async def follow(ws: aiohttp.ClientWebSocketResponse, prompt_id: str, timeout: float = 120.0) -> Followed:
    """Read messages until `executing` with node null for `prompt_id` (script_examples' loop)."""
    followed = Followed()

    async def read() -> None:
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                followed.frames.append(message.data)
                continue
            if message.type != aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"the websocket ended: {message.type}")
            parsed = json.loads(message.data)
            followed.messages.append(parsed)
            data = parsed["data"]
            if parsed["type"] == "executing" and data["node"] is None and data["prompt_id"] == prompt_id:
                return
        raise AssertionError("the websocket closed before the prompt finished")

    await asyncio.wait_for(read(), timeout)
    return followed


async def queue_and_follow(url: str, prompt: dict[str, Any], client_id: str = "test-client",
                           **fields: Any) -> tuple[str, Followed]:
    """Connect the websocket, POST the prompt, follow it to the end; returns (prompt id, messages)."""
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{url}/prompt", json={"prompt": prompt, "client_id": client_id,
                                                           **fields}) as answer:
                body = await answer.json()
                assert answer.status == 200, body
            followed = await follow(ws, body["prompt_id"])
            followed.answer = body
            return body["prompt_id"], followed


def preview_header(frame: bytes) -> tuple[int, int]:
    """(event type, image format) of a binary preview message."""
    return struct.unpack(">II", frame[:8])


def default_prompt(lookup: Any, **sampler: Any) -> dict[str, Any]:
    """The default workflow (the embedded model) as an API prompt; `sampler` overrides KSampler inputs."""
    workflow = Workflow.load(resources_dir() / "workflows" / "default.json")
    prompt = to_api_prompt(workflow, lookup)
    sampler_id = next(node_id for node_id, node in prompt.items() if node["class_type"] == "KSampler")
    prompt[sampler_id]["inputs"].update(sampler)
    return prompt


def image_prompt(color: int = 0x336699, size: int = 16, prefix: str = "solid") -> dict[str, Any]:
    """EmptyImage -> SaveImage: an output without any model."""
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": size, "height": size, "batch_size": 1,
                                                         "color": color}},
            "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}}}
