"""Every route of `sluice serve` with ComfyUI's paths, JSON shapes and status codes (also under /api), and
the error shapes of the prompt route. Prompts here use no model (EmptyImage -> SaveImage) or the test
nodes of conftest.py (ServeWait holds the queue, ServeFail raises)."""

import asyncio
import io
import json
import time

import aiohttp
import pytest
from PIL import Image
from serve_client import follow, image_prompt, queue_and_follow, request

WAIT_PROMPT = {"1": {"class_type": "ServeWait", "inputs": {}}}


def post_prompt(url, prompt, **fields):
    return request("POST", f"{url}/prompt", json={"prompt": prompt, **fields})


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def running_id(url):
    running = request("GET", f"{url}/queue").json()["queue_running"]
    return running[0][1] if running else None


# -- POST /prompt --

def test_post_prompt_answers_prompt_id_number_and_node_errors(start_server):
    url, _ = start_server()
    first = post_prompt(url, image_prompt())
    assert first.status == 200
    body = first.json()
    assert set(body) == {"prompt_id", "number", "node_errors"} and body["node_errors"] == {}
    chosen = post_prompt(url, image_prompt(), prompt_id="my-own-id").json()
    assert chosen["prompt_id"] == "my-own-id" and chosen["number"] == body["number"] + 1
    front = post_prompt(url, image_prompt(), front=True).json()
    assert front["number"] == -(body["number"] + 2)
    given = post_prompt(url, image_prompt(), number=7.5).json()
    assert given["number"] == 7.5
    wait_until(lambda: len(request("GET", f"{url}/history").json()) == 4)


def test_front_prompts_run_before_queued_ones(start_server, release):
    url, _ = start_server()
    holder = post_prompt(url, WAIT_PROMPT).json()["prompt_id"]
    wait_until(lambda: running_id(url) == holder)
    later = post_prompt(url, image_prompt(prefix="later")).json()["prompt_id"]
    first = post_prompt(url, image_prompt(prefix="first"), front=True).json()["prompt_id"]
    pending = request("GET", f"{url}/queue").json()["queue_pending"]
    assert [entry[1] for entry in pending] == [first, later]
    release.set()
    wait_until(lambda: len(request("GET", f"{url}/history").json()) == 3)
    assert list(request("GET", f"{url}/history").json()) == [holder, first, later]


def test_post_prompt_without_prompt_is_comfyuis_no_prompt_error(start_server):
    url, _ = start_server()
    reply = request("POST", f"{url}/prompt", json={"client_id": "x"})
    assert reply.status == 400
    assert reply.json() == {"error": {"type": "no_prompt", "message": "No prompt provided",
                                      "details": "No prompt provided", "extra_info": {}}, "node_errors": {}}


@pytest.mark.parametrize("prompt, message", [
    ({"1": {"class_type": "NoSuchNode", "inputs": {}}},
     "Cannot execute because node NoSuchNode does not exist."),
    ({"1": {"inputs": {}}}, "Cannot execute because a node is missing the class_type property."),
])
def test_unknown_or_missing_class_type_is_an_invalid_prompt(start_server, prompt, message):
    url, _ = start_server()
    reply = post_prompt(url, prompt)
    assert reply.status == 400
    body = reply.json()
    assert body["error"] == {"type": "invalid_prompt", "message": message, "details": "Node ID '#1'",
                             "extra_info": {}}
    assert body["node_errors"] == {}


def test_prompt_without_output_nodes_is_refused(start_server):
    url, _ = start_server()
    reply = post_prompt(url, {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8,
                                                                          "batch_size": 1, "color": 0}}})
    assert reply.status == 400
    assert reply.json()["error"]["type"] == "prompt_no_outputs"


def test_every_validation_error_is_listed_under_its_node(start_server):
    url, _ = start_server()
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": "wide", "height": 99999, "batch_size": 0,
                                                     "color": 0}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "ok"}},
        "3": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ok"}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "ok"}},
        "6": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "no_such_sampler"}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "ok"}},
    }
    reply = post_prompt(url, prompt)
    assert reply.status == 400
    body = reply.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["error"]["message"] == "Prompt outputs failed validation"
    errors = body["node_errors"]
    assert set(errors) == {"1", "3", "5", "6", "7"}
    assert [(e["type"], e["extra_info"].get("input_name")) for e in errors["1"]["errors"]] == [
        ("invalid_input_type", "width"), ("value_bigger_than_max", "height"), ("value_smaller_than_min",
                                                                                "batch_size")]
    assert errors["1"]["class_type"] == "EmptyImage" and errors["1"]["dependent_outputs"] == ["2"]
    assert errors["1"]["errors"][1]["message"] == "Value 99999 bigger than max of 16384"
    assert [e["type"] for e in errors["3"]["errors"]] == ["required_input_missing"]
    assert errors["3"]["errors"][0]["details"] == "images"
    assert [e["type"] for e in errors["5"]["errors"]] == ["return_type_mismatch"]
    (not_listed,) = errors["6"]["errors"]
    assert not_listed["type"] == "value_not_in_list" and not_listed["extra_info"]["received_value"] == \
        "no_such_sampler"
    assert not_listed["details"].startswith("sampler_name: 'no_such_sampler' not in (list of length ")
    assert "Value not in list: sampler_name" in body["error"]["details"]


def test_sound_outputs_run_and_unsound_ones_are_reported(start_server):
    url, _ = start_server()
    prompt = {**image_prompt(),
              "3": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "../out"}}}
    prompt_id, followed = asyncio.run(queue_and_follow(url, prompt, client_id="partial"))
    (problem,) = followed.answer["node_errors"]["3"]["errors"]
    assert problem["type"] == "custom_validation_failed" and "filename_prefix" in problem["details"]
    assert followed.answer["node_errors"]["3"]["dependent_outputs"] == ["3"]
    assert [data["node"] for data in followed.of("executed")] == ["2"]
    entry = request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]
    assert entry["prompt"][4] == ["2"] and list(entry["outputs"]) == ["2"]


def test_widget_values_are_converted_as_comfyui_converts_them(start_server):
    url, _ = start_server()
    prompt = {"1": {"class_type": "EmptyImage", "inputs": {"width": "8", "height": 8.0, "batch_size": 1,
                                                           "color": {"__value__": 255}}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": 42}}}
    prompt_id, followed = asyncio.run(queue_and_follow(url, prompt))
    assert followed.of("executed")[0]["output"]["images"][0]["filename"].startswith("42_")


def test_duplicate_pending_prompt_id_is_refused(start_server, release):
    url, _ = start_server()
    assert post_prompt(url, WAIT_PROMPT, prompt_id="same").status == 200
    reply = post_prompt(url, WAIT_PROMPT, prompt_id="same")
    assert reply.status == 400 and reply.json()["error"]["type"] == "duplicate_prompt_id"


# -- GET /prompt, /queue, POST /queue, /interrupt --

def test_queue_routes_show_running_and_pending_and_delete_or_clear_them(start_server, release):
    url, _ = start_server()
    assert request("GET", f"{url}/prompt").json() == {"exec_info": {"queue_remaining": 0}}
    holder = post_prompt(url, WAIT_PROMPT, client_id="c").json()["prompt_id"]
    wait_until(lambda: running_id(url) == holder)
    pending = [post_prompt(url, image_prompt()).json()["prompt_id"] for _ in range(3)]
    queue = request("GET", f"{url}/queue").json()
    assert set(queue) == {"queue_running", "queue_pending"}
    (running,) = queue["queue_running"]
    assert running[1] == holder and running[2] == WAIT_PROMPT
    assert running[3] == {"client_id": "c"} and running[4] == ["1"]
    assert [entry[1] for entry in queue["queue_pending"]] == pending
    assert request("GET", f"{url}/prompt").json() == {"exec_info": {"queue_remaining": 4}}

    assert request("POST", f"{url}/queue", json={"delete": [pending[1]]}).status == 200
    assert [e[1] for e in request("GET", f"{url}/queue").json()["queue_pending"]] == [pending[0], pending[2]]
    assert request("POST", f"{url}/queue", json={"clear": True}).status == 200
    assert request("GET", f"{url}/queue").json()["queue_pending"] == []

    assert request("POST", f"{url}/interrupt", json={"prompt_id": "another"}).status == 200
    time.sleep(0.1)
    assert running_id(url) == holder  # an interrupt for another prompt leaves this one running
    assert request("POST", f"{url}/interrupt").status == 200  # no body: the running prompt
    wait_until(lambda: holder in request("GET", f"{url}/history").json())
    status = request("GET", f"{url}/history/{holder}").json()[holder]["status"]
    assert status["status_str"] == "error"
    assert [event for event, _ in status["messages"]][-1] == "execution_interrupted"


# -- history --

def test_history_routes_list_limit_delete_and_clear(start_server):
    url, _ = start_server()
    ids = [asyncio.run(queue_and_follow(url, image_prompt(color=c)))[0] for c in (1, 2, 3)]
    history = request("GET", f"{url}/history").json()
    assert list(history) == ids
    entry = history[ids[0]]
    assert set(entry) == {"prompt", "outputs", "status", "meta"}
    assert entry["meta"]["2"] == {"node_id": "2", "display_node": "2", "parent_node": None,
                                  "real_node_id": "2"}
    assert list(request("GET", f"{url}/history", params={"max_items": "2"}).json()) == ids[1:]
    assert list(request("GET", f"{url}/history", params={"max_items": "1", "offset": "0"}).json()) == ids[:1]
    assert request("GET", f"{url}/history/{ids[1]}").json() == {ids[1]: history[ids[1]]}
    assert request("GET", f"{url}/history/unknown").json() == {}
    assert request("POST", f"{url}/history", json={"delete": [ids[0]]}).status == 200
    assert list(request("GET", f"{url}/history").json()) == ids[1:]
    assert request("POST", f"{url}/history", json={"clear": True}).status == 200
    assert request("GET", f"{url}/history").json() == {}


# -- view and uploads --

def test_view_serves_output_files_and_converts_channels(start_server, serve_settings):
    url, _ = start_server()
    _, followed = asyncio.run(queue_and_follow(url, image_prompt(color=0x102030, prefix="sub/solid")))
    ref = followed.of("executed")[0]["output"]["images"][0]
    assert ref["subfolder"] == "sub"
    reply = request("GET", f"{url}/view", params=ref)
    assert reply.status == 200 and reply.headers["Content-Type"] == "image/png"
    assert reply.body == (serve_settings.output_dir / "sub" / ref["filename"]).read_bytes()
    rgb = request("GET", f"{url}/view", params={**ref, "channel": "rgb"})
    assert Image.open(io.BytesIO(rgb.body)).mode == "RGB"
    preview = request("GET", f"{url}/view", params={**ref, "preview": "jpeg;80"})
    assert preview.headers["Content-Type"] == "image/jpeg" and preview.body[:2] == b"\xff\xd8"
    annotated = request("GET", f"{url}/view", params={"filename": f"{ref['filename']} [output]",
                                                      "subfolder": "sub"})
    assert annotated.body == reply.body
    assert request("GET", f"{url}/view").status == 404
    assert request("GET", f"{url}/view", params={"filename": "missing.png"}).status == 404
    assert request("GET", f"{url}/view", params={**ref, "type": "elsewhere"}).status == 400


def test_preview_images_are_temp_files_served_by_view(start_server, serve_settings):
    url, _ = start_server()
    prompt = {"1": image_prompt(color=0x0000FF)["1"],
              "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}
    prompt_id, followed = asyncio.run(queue_and_follow(url, prompt))
    (ref,) = followed.of("executed")[0]["output"]["images"]
    assert ref["type"] == "temp"
    history = request("GET", f"{url}/history/{prompt_id}").json()
    assert history[prompt_id]["outputs"] == {"2": {"images": [ref]}}
    reply = request("GET", f"{url}/view", params=ref)
    assert reply.status == 200
    assert Image.open(io.BytesIO(reply.body)).convert("RGB").getpixel((0, 0)) == (0, 0, 255)
    assert request("GET", f"{url}/view", params={**ref, "type": "output"}).status == 404
    assert not serve_settings.output_dir.exists() or not any(serve_settings.output_dir.iterdir())


def png_bytes(color=(255, 0, 0, 255), size=(8, 8)):
    buffer = io.BytesIO()
    Image.new("RGBA", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def upload(url, route, name, data, **fields):
    form = aiohttp.FormData()
    form.add_field("image", data, filename=name, content_type="image/png")
    for key, value in fields.items():
        form.add_field(key, value)
    return request("POST", f"{url}/upload/{route}", data=form)


def test_uploaded_image_is_loaded_by_loadimage(start_server, serve_settings):
    url, _ = start_server()
    reply = upload(url, "image", "red.png", png_bytes(), subfolder="uploads")
    assert reply.status == 200
    assert reply.json() == {"name": "red.png", "subfolder": "uploads", "type": "input"}
    assert (serve_settings.output_dir.parent / "input" / "uploads" / "red.png").read_bytes() == png_bytes()
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "uploads/red.png"}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "copy"}}}
    _, followed = asyncio.run(queue_and_follow(url, prompt))
    ref = followed.of("executed")[0]["output"]["images"][0]
    copy = Image.open(io.BytesIO(request("GET", f"{url}/view", params=ref).body))
    assert copy.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    prompt["1"]["inputs"]["image"] = f"{ref['filename']} [output]"  # ComfyUI's name of an output image
    prompt["2"]["inputs"]["filename_prefix"] = "copy of copy"
    _, again = asyncio.run(queue_and_follow(url, prompt))
    assert again.of("executed")[0]["output"]["images"][0]["filename"].startswith("copy of copy_")
    info = request("GET", f"{url}/object_info/LoadImage").json()["LoadImage"]
    assert info["input"]["required"]["image"] == [["uploads/red.png"], {"image_upload": True}]


def test_mask_upload_puts_the_masks_alpha_on_the_original(start_server):
    url, _ = start_server()
    upload(url, "image", "photo.png", png_bytes((0, 0, 255, 255)))
    ref = json.dumps({"filename": "photo.png", "subfolder": "", "type": "input"})
    reply = upload(url, "mask", "photo-mask.png", png_bytes((0, 0, 0, 64)), original_ref=ref)
    assert reply.status == 200 and reply.json()["name"] == "photo-mask.png"
    masked = request("GET", f"{url}/view", params={"filename": "photo-mask.png", "type": "input"})
    assert Image.open(io.BytesIO(masked.body)).getpixel((0, 0)) == (0, 0, 255, 64)


# -- catalogue, system, models --

def test_object_info_lists_every_node_and_one_node(start_server, serve_registry):
    url, _ = start_server()
    everything = request("GET", f"{url}/object_info").json()
    assert sorted(everything) == sorted(node_type.type_name for node_type in serve_registry.types())
    one = request("GET", f"{url}/object_info/KSampler").json()
    assert one == {"KSampler": everything["KSampler"]}
    assert request("GET", f"{url}/object_info/NoSuchNode").json() == {}


def test_system_stats_has_comfyuis_shape(start_server):
    url, _ = start_server()
    stats = request("GET", f"{url}/system_stats").json()
    assert {"os", "ram_total", "ram_free", "comfyui_version", "python_version", "pytorch_version",
            "embedded_python", "argv"} <= set(stats["system"])
    assert stats["system"]["ram_total"] > 0
    device = stats["devices"][-1]
    assert set(device) == {"name", "type", "index", "vram_total", "vram_free", "torch_vram_total",
                           "torch_vram_free"}
    assert device["type"] == "cpu"


def test_models_and_embeddings_list_the_model_folders(start_server, serve_settings):
    url, _ = start_server()
    (serve_settings.models_root / "embeddings").mkdir(parents=True)
    (serve_settings.models_root / "embeddings" / "style.safetensors").write_bytes(b"x")
    assert "checkpoints" in request("GET", f"{url}/models").json()
    assert "sluice-shapes.safetensors" in request("GET", f"{url}/models/checkpoints").json()
    assert request("GET", f"{url}/models/clip").json() == request("GET", f"{url}/models/text_encoders").json()
    missing = request("GET", f"{url}/models/nonsense")
    assert missing.status == 404 and "unknown model folder" in missing.json()["error"]["message"]
    assert request("GET", f"{url}/embeddings").json() == ["style"]


def test_free_drops_cached_results_between_prompts(start_server):
    url, server = start_server()
    asyncio.run(queue_and_follow(url, image_prompt()))
    assert server.executor.cached_node_ids() == ["1", "2"]
    assert request("POST", f"{url}/free", json={"unload_models": True, "free_memory": True}).status == 200
    wait_until(lambda: server.executor.cached_node_ids() == [])
    _, again = asyncio.run(queue_and_follow(url, image_prompt()))
    assert again.of("execution_cached")[0]["nodes"] == []


@pytest.mark.parametrize("path", ["/prompt", "/queue", "/history", "/object_info", "/object_info/SaveImage",
                                  "/system_stats", "/models", "/models/checkpoints", "/embeddings",
                                  "/features"])
def test_get_routes_answer_the_same_under_api(start_server, path):
    url, _ = start_server()
    plain, prefixed = request("GET", url + path), request("GET", f"{url}/api{path}")
    assert plain.status == prefixed.status == 200
    if path != "/system_stats":  # free memory changes between the two calls
        assert plain.json() == prefixed.json()


def test_post_routes_answer_under_api(start_server):
    url, _ = start_server()
    prompt_id, followed = asyncio.run(queue_and_follow(f"{url}/api", image_prompt(), client_id="api"))
    assert followed.types()[0] == "status" and "execution_success" in followed.types()  # /api/ws
    ref = followed.of("executed")[0]["output"]["images"][0]
    view, prefixed = request("GET", f"{url}/view", params=ref), request("GET", f"{url}/api/view", params=ref)
    assert view.status == prefixed.status == 200 and view.body == prefixed.body
    assert request("GET", f"{url}/api/history/{prompt_id}").json() == request(
        "GET", f"{url}/history/{prompt_id}").json()
    assert request("POST", f"{url}/api/prompt", json={"prompt": image_prompt()}).status == 200
    assert request("POST", f"{url}/api/interrupt").status == 200
    assert request("POST", f"{url}/api/queue", json={"clear": True}).status == 200
    assert request("POST", f"{url}/api/free", json={}).status == 200
    assert request("POST", f"{url}/api/history", json={"delete": [prompt_id]}).status == 200
    assert prompt_id not in request("GET", f"{url}/history").json()
    assert upload(f"{url}/api", "image", "a.png", png_bytes()).status == 200
    mask_ref = json.dumps({"filename": "a.png", "subfolder": "", "type": "input"})
    mask = upload(f"{url}/api", "mask", "a-mask.png", png_bytes((0, 0, 0, 9)), original_ref=mask_ref)
    assert mask.status == 200 and mask.json() == {"name": "a-mask.png", "subfolder": "", "type": "input"}


# -- the websocket --

def test_websocket_failures_and_client_ids(start_server):
    url, _ = start_server()
    prompt = {**image_prompt(), "3": {"class_type": "ServeFail", "inputs": {"value": ["1", 0]}}}
    prompt_id, followed = asyncio.run(queue_and_follow(url, prompt, client_id="failing"))
    (error,) = followed.of("execution_error")
    assert error["node_id"] == "3" and error["node_type"] == "ServeFail"
    assert error["exception_type"] == "RuntimeError"
    assert error["exception_message"] == "the test node failed on purpose"
    assert isinstance(error["traceback"], list) and error["traceback"]
    assert {"prompt_id", "executed", "current_inputs", "current_outputs", "timestamp"} <= set(error)
    assert followed.types()[-2:] == ["status", "executing"]
    status = request("GET", f"{url}/history/{prompt_id}").json()[prompt_id]["status"]
    assert status == {"status_str": "error", "completed": False, "messages": status["messages"]}

    async def connect_without_id():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws") as ws:
                first = json.loads((await ws.receive()).data)
                return first

    first = asyncio.run(connect_without_id())
    assert first["type"] == "status" and len(first["data"]["sid"]) == 32


def test_websocket_answers_comfyuis_feature_flags_once(start_server):
    url, _ = start_server(max_upload_bytes=12345)

    async def replies(first, second, answers):
        """Send two messages; read `answers` replies, then check that no other comes within a second."""
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=flags") as ws:
                assert json.loads((await ws.receive()).data)["type"] == "status"
                await ws.send_str(json.dumps(first))
                await ws.send_str(json.dumps(second))
                got = [json.loads((await ws.receive(timeout=60)).data) for _ in range(answers)]
                with pytest.raises(asyncio.TimeoutError):
                    await ws.receive(timeout=1)
                return got

    flags = {"type": "feature_flags", "data": {"supports_preview_metadata": True}}
    (answer,) = asyncio.run(replies(flags, flags, 1))  # the first message negotiates, a later one not
    assert answer == {"type": "feature_flags", "data": {"supports_preview_metadata": False,
                                                        "max_upload_size": 12345}}
    assert answer["data"] == request("GET", f"{url}/features").json()
    assert asyncio.run(replies({"type": "something else"}, flags, 0)) == []


def test_sluice_memory_snapshots_go_to_clients_that_ask(start_server):
    url, _ = start_server(memory_interval=0.05)

    async def kinds(query):
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=m{query}{query and '&'}") as ws:
                seen = []

                async def read():
                    async for message in ws:
                        seen.append(json.loads(message.data))

                try:
                    await asyncio.wait_for(read(), 0.6)
                except asyncio.TimeoutError:
                    pass
                return seen

    with_memory = asyncio.run(kinds("&sluice_memory=1"))
    memory = [message["data"] for message in with_memory if message["type"] == "sluice.memory"]
    assert memory and set(memory[0]) == {"devices", "modules"}
    assert all(message["type"] != "sluice.memory" for message in asyncio.run(kinds("")))


def test_reconnecting_client_gets_the_running_node(start_server, release):
    url, _ = start_server()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=back") as ws:
                body = {"prompt": WAIT_PROMPT, "client_id": "back"}
                async with session.post(f"{url}/prompt", json=body) as answer:
                    prompt_id = (await answer.json())["prompt_id"]
                async for message in ws:
                    if json.loads(message.data)["type"] == "executing":
                        break
            async with session.ws_connect(f"{url}/ws?clientId=back") as ws:
                first, second = json.loads((await ws.receive()).data), json.loads((await ws.receive()).data)
                release.set()
                await follow(ws, prompt_id)
                return first, second

    first, second = asyncio.run(scenario())
    assert first["type"] == "status" and first["data"]["sid"] == "back"
    assert second == {"type": "executing", "data": {"node": "1", "display_node": "1", "prompt_id":
                                                    second["data"]["prompt_id"]}}
