"""`sluice serve --ray`: the server's prompts run on two local Ray CPU workers (app/server/ray_backend.py)
behind the same API: two prompts queued at once both finish with ComfyUI's messages in order, /history holds
both and /view serves their images; preview frames and progress come while a worker samples, and an
interrupt reaches it; an uploaded image reaches the worker that loads it; without Ray, --ray says how to
install it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys

import aiohttp
import numpy as np
import pytest
from PIL import Image
from serve_client import default_prompt, preview_header, queue_and_follow, request

from app.cli import main
from app.server.server import BackgroundServer, ServerOptions, SluiceServer
from engine.cluster.worker import SluiceWorker
from engine.graph.comfy import from_comfy_api
from nodes.registry import default_registry

SIDE = 64


@pytest.fixture(scope="module")
def workers():
    ray = pytest.importorskip("ray")
    from engine.cluster.scheduler import start_workers

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)  # 1 spare
    handles = start_workers(2, default_registry)
    yield handles
    for handle in handles:
        ray.kill(handle, no_restart=True)
    ray.shutdown()


@contextlib.contextmanager
def _serving(settings, registry, handles):
    from app.server.ray_backend import RayEngine

    def engine(server: SluiceServer) -> RayEngine:
        return RayEngine(server.queue, server, settings, registry.get, handles)

    server = SluiceServer(settings, registry, ServerOptions(), engine)
    with BackgroundServer(server) as url:
        yield url, server


@pytest.fixture
def ray_server(serve_settings, serve_registry, workers):
    with _serving(serve_settings, serve_registry, workers) as served:
        yield served


def _prompt(lookup, seed: int, steps: int = 2) -> dict:
    prompt = default_prompt(lookup, seed=seed, steps=steps)
    latent = next(node for node in prompt.values() if node["class_type"] == "EmptyLatentImage")
    latent["inputs"].update(width=SIDE, height=SIDE)
    return prompt


async def _two(url: str, prompts: list[dict]) -> list:
    return await asyncio.gather(*(queue_and_follow(url, prompt, client_id=f"client-{index}")
                                  for index, prompt in enumerate(prompts)))


def test_two_prompts_run_on_the_ray_workers_behind_the_same_api(ray_server, serve_registry,
                                                                one_torch_thread) -> None:
    url, server = ray_server
    prompts = [_prompt(serve_registry.get, seed) for seed in (11, 12)]
    followed = asyncio.run(_two(url, prompts))
    history = request("GET", f"{url}/history").json()
    local = SluiceWorker(default_registry)  # each prompt run alone, in this process
    try:
        for (prompt_id, messages), prompt in zip(followed, prompts, strict=True):
            types = [kind for kind in messages.types() if kind != "status"]
            assert types[:2] == ["execution_start", "execution_cached"] and types[-2:] == [
                "execution_success", "executing"], types
            ran = [data["node"] for data in messages.of("executing") if data["node"] is not None]
            assert ran and "8" in ran  # the nodes that ran, SaveImage among them
            (executed,) = messages.of("executed")
            (ref,) = executed["output"]["images"]
            assert history[prompt_id]["outputs"] == {executed["node"]: executed["output"]}
            assert history[prompt_id]["status"]["status_str"] == "success"
            view = request("GET", f"{url}/view", params=ref)
            assert view.status == 200
            with Image.open(io.BytesIO(view.body)) as image:
                served = np.asarray(image.convert("RGB"))
            alone = local.run(from_comfy_api(prompt, serve_registry.get)[0].dumps())
            with Image.open(io.BytesIO(alone.images[0][1])) as image:
                assert np.array_equal(served, np.asarray(image.convert("RGB")))
    finally:
        local.close()
    assert len({ref["filename"] for _, m in followed for ref in m.of("executed")[0]["output"]["images"]}) == 2
    assert request("GET", f"{url}/queue").json() == {"queue_running": [], "queue_pending": []}
    assert server.executor is None and sum(worker.done for worker in server.engine.scheduler.workers) == 2


def test_progress_comes_while_the_worker_samples_and_an_interrupt_reaches_it(ray_server,
                                                                             serve_registry) -> None:
    url, _ = ray_server
    prompt = {"prompt": _prompt(serve_registry.get, 3, steps=10000), "client_id": "sampler"}

    frames: list[bytes] = []

    async def interrupted() -> tuple[str, list[dict]]:
        messages: list[dict] = []
        interrupted_at = None
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=sampler") as ws:
                async with session.post(f"{url}/prompt", json=prompt) as answer:
                    prompt_id = (await answer.json())["prompt_id"]
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        frames.append(message.data)
                        continue
                    messages.append(json.loads(message.data))
                    kind, data = messages[-1]["type"], messages[-1]["data"]
                    if kind == "progress" and frames and interrupted_at is None:  # sampling, live: interrupt
                        interrupted_at = data["value"]
                        async with session.post(f"{url}/interrupt", json={"prompt_id": prompt_id}) as reply:
                            assert reply.status == 200
                    if kind == "executing" and data["node"] is None:
                        return prompt_id, messages
        raise AssertionError("the websocket closed before the prompt ended")

    prompt_id, messages = asyncio.run(asyncio.wait_for(interrupted(), 120))
    assert frames and all(preview_header(frame) == (1, 1) for frame in frames)  # PREVIEW_IMAGE, JPEG
    with Image.open(io.BytesIO(frames[-1][8:])) as image:
        assert image.format == "JPEG" and image.size == (SIDE, SIDE)
    types = [message["type"] for message in messages if message["type"] != "status"]
    sampler = next(index for index, message in enumerate(messages)
                   if message["type"] == "executing" and message["data"]["node"] == "6")
    progress = [message["data"] for message in messages[sampler:] if message["type"] == "progress"]
    assert progress and all(data["node"] == "6" and data["max"] == 10000 for data in progress)
    assert [data["value"] for data in progress] == sorted({data["value"] for data in progress})  # rising
    assert types[:2] == ["execution_start", "execution_cached"] and types[-2:] == [
        "execution_interrupted", "executing"], types
    (stopped,) = [message["data"] for message in messages if message["type"] == "execution_interrupted"]
    assert stopped["node_type"] == "KSampler" and stopped["node_id"] == "6"
    assert request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]["status"]["status_str"] == "error"


def test_an_uploaded_image_reaches_the_worker_that_loads_it(ray_server, serve_settings) -> None:
    url, _ = ray_server
    pixels = np.zeros((16, 24, 3), dtype=np.uint8)
    pixels[:, :12] = (250, 10, 60)
    upload = io.BytesIO()
    Image.fromarray(pixels).save(upload, format="PNG")
    form = aiohttp.FormData()
    form.add_field("image", upload.getvalue(), filename="ray-upload.png", content_type="image/png")
    form.add_field("subfolder", "shared")
    reply = request("POST", f"{url}/upload/image", data=form)
    assert reply.status == 200, reply.body
    assert reply.json() == {"name": "ray-upload.png", "subfolder": "shared", "type": "input"}, reply.json()
    assert (serve_settings.output_dir.parent / "input" / "shared" / "ray-upload.png").is_file()
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "shared/ray-upload.png"}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "loaded"}}}
    _, messages = asyncio.run(queue_and_follow(url, prompt))
    assert messages.of("execution_success"), messages.messages
    (executed,) = messages.of("executed")
    (ref,) = executed["output"]["images"]
    with Image.open(io.BytesIO(request("GET", f"{url}/view", params=ref).body)) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), pixels)


def test_a_prompt_whose_worker_dies_runs_on_another_or_fails_when_none_is_left(
        serve_settings, serve_registry, workers) -> None:
    import ray

    from engine.cluster.scheduler import start_workers

    victim = start_workers(1, default_registry)[0]
    with _serving(serve_settings, serve_registry, [victim, workers[0]]) as (url, server):
        asyncio.run(queue_and_follow(url, _prompt(serve_registry.get, 5)))  # the first idle worker: victim
        ray.kill(victim, no_restart=True)  # the next prompt goes to victim again, which holds its models
        prompt_id, messages = asyncio.run(queue_and_follow(url, _prompt(serve_registry.get, 6)))
        assert messages.of("execution_success") and len(server.engine.scheduler.deaths) == 1
        assert request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]["outputs"]
    with _serving(serve_settings, serve_registry, [victim]) as (url, server):  # only the dead one
        prompt_id, messages = asyncio.run(queue_and_follow(url, _prompt(serve_registry.get, 5)))
        (error,) = messages.of("execution_error")
        assert error["exception_type"] == "WorkerLost" and "died" in error["exception_message"]
        entry = request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]
        assert entry["status"]["status_str"] == "error"


def test_serve_ray_without_ray_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["serve", "--ray", "auto", "--port", "0"]) == 2
    assert "pip install 'sluice[cluster]'" in capsys.readouterr().err
