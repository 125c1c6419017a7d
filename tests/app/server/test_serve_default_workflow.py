"""`sluice serve` driven the way ComfyUI's script_examples drive ComfyUI: the default workflow (the embedded
model) queued in API format, followed on the websocket to `executing` with node null, its image fetched
through /history and /view; then the same executor's caching across prompts and interrupts within a step."""

import asyncio
import io
import json

import aiohttp
from PIL import Image
from serve_client import default_prompt, follow, preview_header, queue_and_follow, request

from engine.graph.executor import Executor
from engine.telemetry import bus


def test_default_workflow_runs_as_in_comfyuis_websocket_example(start_server, serve_registry, serve_settings):
    url, _ = start_server()
    prompt = default_prompt(serve_registry.get)
    prompt_id, followed = asyncio.run(queue_and_follow(url, prompt, client_id="example"))

    types = followed.types()
    assert types[0] == "status" and followed.messages[0]["data"]["sid"] == "example"
    start = types.index("execution_start")
    assert types[start + 1] == "execution_cached"
    (cached,) = followed.of("execution_cached")
    assert cached == {"nodes": [], "prompt_id": prompt_id, "timestamp": cached["timestamp"]}
    executing = [data["node"] for data in followed.of("executing")]
    assert executing == ["1", "2", "3", "4", "5", "6", "7", "8", None]
    assert all(data["prompt_id"] == prompt_id for data in followed.of("executing"))
    steps = [(data["value"], data["max"]) for data in followed.of("progress") if data["node"] == "6"]
    assert steps == [(step, 20) for step in range(1, 21)]
    assert types[-4:] == ["executed", "execution_success", "status", "executing"]
    assert followed.of("status")[-1] == {"status": {"exec_info": {"queue_remaining": 0}}}
    (executed,) = followed.of("executed")
    assert executed["node"] == "8" and executed["prompt_id"] == prompt_id
    (image_ref,) = executed["output"]["images"]
    assert image_ref["type"] == "output" and image_ref["subfolder"] == ""

    assert followed.frames, "no preview frames while sampling"
    for frame in followed.frames:
        assert preview_header(frame) == (1, 1)  # PREVIEW_IMAGE, JPEG
        assert frame[8:10] == b"\xff\xd8"

    history = request("GET", f"{url}/history/{prompt_id}").json()
    entry = history[prompt_id]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert [event for event, _ in entry["status"]["messages"]] == ["execution_start", "execution_cached",
                                                                   "execution_success"]
    assert entry["prompt"][1] == prompt_id and entry["prompt"][2] == prompt and entry["prompt"][4] == ["8"]
    assert entry["outputs"] == {"8": {"images": [image_ref]}}
    view = request("GET", f"{url}/view", params=image_ref)
    assert view.status == 200
    assert view.body == (serve_settings.output_dir / image_ref["filename"]).read_bytes()
    image = Image.open(io.BytesIO(view.body))
    assert image.size == (128, 128)
    assert json.loads(image.text["prompt"])["6"]["class_type"] == "KSampler"


def test_cached_nodes_stay_cached_and_models_stay_loaded_across_prompts(start_server, serve_registry):
    url, server = start_server()
    assert type(server.executor) is Executor  # the class `sluice run` and the GUI's worker run
    first_id, _ = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=2, seed=1)))
    second_id, second = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=2,
                                                                          seed=2)))
    assert second.of("execution_cached")[0]["nodes"] == ["1", "2", "3", "4", "5"]
    assert [data["node"] for data in second.of("executing")] == ["6", "7", "8", None]

    # The same prompt again: everything is cached and the output node reports its last images again.
    third_id, third = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=2, seed=2)))
    assert third.of("execution_cached")[0]["nodes"] == ["1", "2", "3", "4", "5", "6", "7", "8"]
    assert [data["node"] for data in third.of("executing")] == [None]
    assert third.of("executed")[0]["output"] == second.of("executed")[0]["output"]
    history = request("GET", f"{url}/history").json()
    assert list(history) == [first_id, second_id, third_id]
    assert history[third_id]["outputs"] == history[second_id]["outputs"]


def test_interrupt_stops_the_sampler_within_a_step(start_server, serve_registry):
    url, server = start_server()
    steps = []  # the sampler's progress events, and how many there were when the interrupt came
    unsubscribe = bus.subscribe(lambda event: steps.append(event) if event.kind == "progress" else None)
    interrupt, steps_at_interrupt = server.executor.interrupt, []
    server.executor.interrupt = lambda: (steps_at_interrupt.append(len(steps)), interrupt())

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=stopper") as ws:
                prompt = default_prompt(serve_registry.get, steps=10000)
                body = {"prompt": prompt, "client_id": "stopper"}
                async with session.post(f"{url}/prompt", json=body) as answer:
                    prompt_id = (await answer.json())["prompt_id"]
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.TEXT and \
                            json.loads(message.data)["type"] == "progress":
                        break
                async with session.post(f"{url}/interrupt", json={"prompt_id": prompt_id}) as answer:
                    assert answer.status == 200
                return prompt_id, await follow(ws, prompt_id)

    prompt_id, followed = asyncio.run(scenario())
    unsubscribe()
    (interrupted,) = followed.of("execution_interrupted")
    assert interrupted["node_id"] == "6" and interrupted["node_type"] == "KSampler"
    assert interrupted["executed"] == ["1", "2", "3", "4", "5"]
    assert "execution_success" not in followed.types()
    assert len(steps) - steps_at_interrupt[0] <= 1, "the sampler ran on for steps after the interrupt"
    assert len(steps) < 10000
    status = request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]["status"]
    assert status["status_str"] == "error" and status["completed"] is False

    _, after = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=1),
                                            client_id="next"))
    assert "execution_success" in after.types()
    assert after.of("execution_cached")[0]["nodes"] == ["1", "2", "3", "4", "5"]


async def every_message_in_order(url, prompt, client_id, **fields):
    """Everything the websocket sends until `executing` with node null, in order: (type, data), with
    binary messages as ("binary", header)."""
    received = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?clientId={client_id}") as ws:
            body = {"prompt": prompt, "client_id": client_id, **fields}
            async with session.post(f"{url}/prompt", json=body) as answer:
                assert answer.status == 200, await answer.text()
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:
                    received.append(("binary", preview_header(message.data)))
                    continue
                parsed = json.loads(message.data)
                received.append((parsed["type"], parsed["data"]))
                if parsed["type"] == "executing" and parsed["data"]["node"] is None:
                    return received
    raise AssertionError("the websocket closed before the prompt finished")


def test_websocket_messages_come_in_comfyuis_order(start_server, serve_registry):
    """ComfyUI's order (execution.py, main.py's prompt worker): status on connecting; execution_start,
    execution_cached; per node run executing, then its progress and preview frames, then executed for a
    node that saved images; execution_success; the queue's status; executing with node null."""
    url, _ = start_server()
    received = asyncio.run(every_message_in_order(url, default_prompt(serve_registry.get, steps=3), "order",
                                                  extra_data={"preview_method": "latent2rgb"}))
    kinds = [kind for kind, _ in received]
    assert kinds[0] == "status" and received[0][1]["sid"] == "order"
    start = kinds.index("execution_start")
    assert set(kinds[:start]) == {"status"}
    assert kinds[start + 1] == "execution_cached"
    assert kinds[-3:] == ["execution_success", "status", "executing"]
    assert received[-1][1]["node"] is None and received[-2][1] == {"status": {"exec_info": {
        "queue_remaining": 0}}}
    running = None  # the node of the last `executing`
    seen = []
    for kind, data in received[start + 2:-3]:
        if kind == "executing":
            running = data["node"]
            seen.append(("executing", running))
        elif kind in ("progress", "executed"):
            assert data["node"] == running, (kind, data)
            seen.append((kind, running))
        elif kind == "binary":
            assert data == (1, 1) and running is not None
            seen.append(("binary", running))
        else:
            raise AssertionError(f"{kind} while nodes run")
    nodes = [node for kind, node in seen if kind == "executing"]
    assert nodes == ["1", "2", "3", "4", "5", "6", "7", "8"]
    assert [node for kind, node in seen if kind == "progress"] == ["6"] * 3
    assert {node for kind, node in seen if kind == "binary"} == {"6"}
    assert seen[-1] == ("executed", "8")


def test_preview_method_of_a_prompt_chooses_its_frames(start_server, serve_registry):
    url, _ = start_server()
    _, none = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=2), client_id="a",
                                           extra_data={"preview_method": "none"}))
    assert none.frames == [] and "execution_success" in none.types()
    _, shown = asyncio.run(queue_and_follow(url, default_prompt(serve_registry.get, steps=2, seed=5),
                                            client_id="b", extra_data={"preview_method": "latent2rgb"}))
    assert len(shown.frames) == 2 and all(preview_header(frame) == (1, 1) for frame in shown.frames)


def test_a_prompt_without_client_id_sends_only_its_progress_and_previews_to_every_client(start_server,
                                                                                         serve_registry):
    """ComfyUI's rule: with no client_id, progress and preview frames go to every client (send_sync with
    sid None), the messages that need a client (execution_*, executing, executed) to none."""
    url, _ = start_server()

    async def watch():
        received = []
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=watcher") as ws:
                await ws.receive()  # status
                body = {"prompt": default_prompt(serve_registry.get, steps=2),
                        "extra_data": {"preview_method": "latent2rgb"}}
                async with session.post(f"{url}/prompt", json=body) as answer:
                    prompt_id = (await answer.json())["prompt_id"]
                busy = False
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        received.append(("binary", None))
                        continue
                    parsed = json.loads(message.data)
                    received.append((parsed["type"], parsed["data"]))
                    if parsed["type"] == "status":
                        remaining = parsed["data"]["status"]["exec_info"]["queue_remaining"]
                        busy = busy or remaining > 0
                        if busy and remaining == 0:
                            return prompt_id, received
        raise AssertionError("the websocket closed")

    prompt_id, received = asyncio.run(watch())
    kinds = [kind for kind, _ in received]
    assert set(kinds) == {"status", "progress", "binary"}
    assert [data["prompt_id"] for kind, data in received if kind == "progress"] == [prompt_id] * 2
    entry = request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]
    assert entry["status"]["status_str"] == "success"
    assert entry["prompt"][3] == {"preview_method": "latent2rgb"}
