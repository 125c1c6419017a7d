"""Load: many prompts queued at once by 8 concurrent clients, each following its own on the websocket; every
prompt runs exactly once and ends in the history. Sized for CI (40 prompts of the embedded model at 2 steps,
about half a minute on two busy cores; SLUICE_SERVE_LOAD_PROMPTS changes the count); bench/serve_load.py
runs the issue's 200 prompts against a `sluice serve` process and reports its memory."""

import asyncio
import json
import os
from collections import Counter

import aiohttp
from serve_client import default_prompt, request

CLIENTS = 8


async def one_client(url, client_id, prompts):
    """Queue all of `prompts` at once, then read the websocket until each has ended; returns
    (prompt ids, Counter of (message type, prompt id))."""
    seen = Counter()
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?clientId={client_id}") as ws:

            async def post(prompt):
                body = {"prompt": prompt, "client_id": client_id}
                async with session.post(f"{url}/prompt", json=body) as answer:
                    assert answer.status == 200, await answer.text()
                    return (await answer.json())["prompt_id"]

            prompt_ids = await asyncio.gather(*(post(prompt) for prompt in prompts))
            waiting = set(prompt_ids)
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                parsed = json.loads(message.data)
                prompt_id = parsed["data"].get("prompt_id")
                seen[parsed["type"], prompt_id] += 1
                if parsed["type"] == "executing" and parsed["data"]["node"] is None:
                    waiting.discard(prompt_id)
                    if not waiting:
                        break
    return prompt_ids, seen


def test_concurrent_clients_queue_many_prompts_and_none_is_lost_or_run_twice(start_server, serve_registry):
    url, _ = start_server()
    total = int(os.environ.get("SLUICE_SERVE_LOAD_PROMPTS", "40"))
    prompts = [default_prompt(serve_registry.get, steps=2, seed=seed) for seed in range(total)]

    async def all_clients():
        batches = [prompts[index::CLIENTS] for index in range(CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(
            *(one_client(url, f"client-{index}", batch) for index, batch in enumerate(batches))), 600)

    results = asyncio.run(all_clients())
    every_id = [prompt_id for prompt_ids, _ in results for prompt_id in prompt_ids]
    assert len(every_id) == len(set(every_id)) == total
    for prompt_ids, seen in results:
        for prompt_id in prompt_ids:
            assert seen["execution_start", prompt_id] == 1, prompt_id
            assert seen["execution_success", prompt_id] == 1, prompt_id
            assert seen["executed", prompt_id] == 1, prompt_id
    history = request("GET", f"{url}/history").json()
    assert set(history) == set(every_id)
    assert all(entry["status"]["status_str"] == "success" for entry in history.values())
    files = {entry["outputs"]["8"]["images"][0]["filename"] for entry in history.values()}
    assert len(files) == total  # one image per prompt, none overwritten
    assert request("GET", f"{url}/queue").json() == {"queue_running": [], "queue_pending": []}
