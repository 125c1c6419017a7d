"""Point 4 of issue 18, one test per bad input: loopback by default, no exposed address without a token (or
--insecure), the token on every route and the websocket, /view and uploads kept inside their folders
(traversal, absolute paths, symbolic links out, NUL bytes), uploads that never overwrite, body size limits,
and malformed bodies answered with a 400 and a message, never a 500."""

import asyncio
import io
import json
import os

import aiohttp
import pytest
from PIL import Image
from serve_client import image_prompt, queue_and_follow, request

from app.cli import build_parser, main
from app.server.server import WS_MAX_MESSAGE, listen_problem

ROUTES = [("GET", "/prompt"), ("POST", "/prompt"), ("GET", "/queue"), ("POST", "/queue"),
          ("POST", "/interrupt"), ("GET", "/history"), ("GET", "/history/x"), ("POST", "/history"),
          ("GET", "/view"), ("POST", "/upload/image"), ("POST", "/upload/mask"), ("GET", "/object_info"),
          ("GET", "/object_info/KSampler"), ("GET", "/system_stats"), ("GET", "/models"),
          ("GET", "/models/checkpoints"), ("GET", "/embeddings"), ("POST", "/free"), ("GET", "/features"),
          ("GET", "/"), ("GET", "/ws")]


def png_bytes(color=(0, 255, 0, 255)):
    buffer = io.BytesIO()
    Image.new("RGBA", (4, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def upload(url, name, data, route="image", **fields):
    form = aiohttp.FormData()
    form.add_field("image", data, filename=name, content_type="image/png")
    for key, value in fields.items():
        form.add_field(key, value)
    return request("POST", f"{url}/upload/{route}", data=form)


def raw_multipart(url, disposition, **fields):
    """An upload with the file part's Content-Disposition parameters as given (aiohttp's FormData would
    percent-encode a separator or a NUL byte in the file name)."""
    boundary = "sluiceboundary"
    parts = [f"--{boundary}\r\nContent-Disposition: form-data; name=\"{key}\"\r\n\r\n{value}\r\n".encode()
             for key, value in fields.items()]
    parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; {disposition}\r\n"
                 f"Content-Type: image/png\r\n\r\n".encode() + png_bytes() + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return request("POST", f"{url}/upload/image", data=body,
                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})


def assert_refused(reply, status):
    assert reply.status == status, reply.body
    message = reply.json()["error"]["message"]
    assert message and "Traceback" not in message
    return message


# -- where it listens --

def test_serve_listens_on_loopback_by_default():
    assert build_parser().parse_args(["serve"]).listen == "127.0.0.1"
    assert build_parser().parse_args(["serve", "--listen"]).listen == "0.0.0.0"  # ComfyUI's bare --listen
    for host in ("127.0.0.1", "::1", "localhost"):
        assert listen_problem([host], None, False) is None


def test_exposed_address_needs_a_token_or_insecure():
    problem = listen_problem(["0.0.0.0"], None, False)
    assert "--auth-token" in problem and "--insecure" in problem
    assert listen_problem(["127.0.0.1", "0.0.0.0"], None, False) is not None
    assert listen_problem(["0.0.0.0"], "secret", False) is None
    assert listen_problem(["0.0.0.0"], None, True) is None


def test_serve_refuses_to_start_on_an_exposed_address_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_AUTH_TOKEN", raising=False)
    assert main(["serve", "--listen", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert "refusing to start" in error and "--auth-token" in error


# -- the token --

def test_with_a_token_every_route_and_the_websocket_need_it(start_server):
    url, _ = start_server(auth_token="s3cret")
    for method, path in ROUTES:
        for prefix in ("", "/api"):
            if prefix and path == "/":
                continue
            reply = request(method, f"{url}{prefix}{path}")
            assert reply.status == 401, (method, prefix + path)
            assert "auth token" in reply.json()["error"]["message"]
            wrong = request(method, f"{url}{prefix}{path}", headers={"Authorization": "Bearer wrong"})
            assert wrong.status == 401, (method, prefix + path)
    good = {"Authorization": "Bearer s3cret"}
    assert request("GET", f"{url}/queue", headers=good).status == 200
    assert request("GET", f"{url}/queue", params={"token": "s3cret"}).status == 200

    async def websocket(query):
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(f"{url}/ws?clientId=t{query}") as ws:
                    return json.loads((await ws.receive()).data)["type"]
            except aiohttp.WSServerHandshakeError as error:
                return error.status

    assert asyncio.run(websocket("")) == 401
    assert asyncio.run(websocket("&token=wrong")) == 401
    assert asyncio.run(websocket("&token=s3cret")) == "status"


def test_without_a_token_a_foreign_web_page_is_refused(start_server):
    url, _ = start_server()
    reply = request("POST", f"{url}/prompt", json={"prompt": image_prompt()},
                    headers={"Origin": "http://evil.example"})
    assert_refused(reply, 403)
    host = url.removeprefix("http://")
    assert request("GET", f"{url}/queue", headers={"Origin": f"http://{host}"}).status == 200

    async def websocket(origin):
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(f"{url}/ws?clientId=page", headers={"Origin": origin}) as ws:
                    return json.loads((await ws.receive()).data)["type"]
            except aiohttp.WSServerHandshakeError as error:
                return error.status

    assert asyncio.run(websocket("http://evil.example")) == 403
    assert asyncio.run(websocket(f"http://{host}")) == "status"


def test_a_loopback_server_without_a_token_answers_loopback_host_names_only(start_server):
    """A page whose DNS name was rebound to 127.0.0.1 sends its own name as Host and Origin: refused."""
    url, _ = start_server()
    port = url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    reply = request("POST", f"{url}/prompt", json={"prompt": image_prompt()}, headers=rebound)
    assert_refused(reply, 403)
    assert reply.json()["error"]["type"] == "forbidden_host" and "evil.example" in reply.json()["error"][
        "message"]

    async def websocket():
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(f"{url}/ws?clientId=rebound", headers=rebound):
                    return 101
            except aiohttp.WSServerHandshakeError as error:
                return error.status

    assert asyncio.run(websocket()) == 403
    for host in ("127.0.0.1", "localhost", "app.localhost", "[::1]"):
        assert request("GET", f"{url}/queue", headers={"Host": f"{host}:{port}"}).status == 200, host
    assert request("GET", f"{url}/history").json() == {}  # nothing was queued


def test_with_a_token_other_host_names_are_answered(start_server):
    url, _ = start_server(auth_token="s3cret")
    port = url.rsplit(":", 1)[1]
    headers = {"Host": f"gpu-box.lan:{port}", "Authorization": "Bearer s3cret"}
    assert request("GET", f"{url}/queue", headers=headers).status == 200


# -- /view stays inside its folders --

@pytest.mark.parametrize("params, status", [
    ({"filename": ""}, 400),
    ({"filename": "../secret.txt"}, 400),
    ({"filename": "/etc/hostname"}, 400),
    ({"filename": "..\\secret.txt"}, 400),
    ({"filename": "a\x00.png"}, 400),
    ({"filename": "x.png", "subfolder": "../.."}, 403),
    ({"filename": "hostname", "subfolder": "/etc"}, 403),
    ({"filename": "x.png", "subfolder": "a\x00b"}, 400),
    ({"filename": "x.png", "type": "models"}, 400),
    ({"filename": "a" * 300 + ".png"}, 400),
    ({"filename": "x.png", "subfolder": "x/" * 3000}, 400),
    ({"filename": "x.png", "subfolder": "b" * 300}, 400),
])
def test_view_refuses_paths_out_of_its_folders(start_server, serve_settings, params, status):
    url, _ = start_server()
    (serve_settings.output_dir.parent / "secret.txt").write_text("secret")
    assert_refused(request("GET", f"{url}/view", params=params), status)


def test_view_refuses_symbolic_links_out_of_the_folder(start_server, serve_settings, tmp_path):
    url, _ = start_server()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes())
    serve_settings.output_dir.mkdir(parents=True)
    os.symlink(outside / "secret.png", serve_settings.output_dir / "link.png")
    os.symlink(outside, serve_settings.output_dir / "linked")
    assert_refused(request("GET", f"{url}/view", params={"filename": "link.png"}), 403)
    linked = {"filename": "secret.png", "subfolder": "linked"}
    assert_refused(request("GET", f"{url}/view", params=linked), 403)
    os.symlink(serve_settings.output_dir / "loop.png", serve_settings.output_dir / "loop.png")
    assert_refused(request("GET", f"{url}/view", params={"filename": "loop.png"}), 404)  # no file to read


def test_prompts_cannot_load_images_from_outside_the_input_folder(start_server, tmp_path):
    url, _ = start_server()
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes())
    for name in (str(outside), "../outside.png", "../../outside.png"):
        prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": name}},
                  "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}
        reply = request("POST", f"{url}/prompt", json={"prompt": prompt})
        assert reply.status == 400, name
        (problem,) = reply.json()["node_errors"]["1"]["errors"]
        assert problem["type"] == "custom_validation_failed" and "Invalid image file" in problem["details"]
    linked = {"1": {"class_type": "PrimitiveString", "inputs": {"value": str(outside)}},
              "2": {"class_type": "LoadImage", "inputs": {"image": ["1", 0]}},
              "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "x"}}}
    reply = request("POST", f"{url}/prompt", json={"prompt": linked})
    assert reply.status == 400
    assert "not through a link" in reply.json()["node_errors"]["2"]["errors"][0]["details"]


# -- uploads stay inside their folders and never overwrite --

@pytest.mark.parametrize("name, fields, status", [
    ("../escape.png", {}, 400),
    ("sub/escape.png", {}, 400),
    ("..", {}, 400),
    ("fine.png", {"subfolder": "../.."}, 403),
    ("fine.png", {"subfolder": "/tmp"}, 403),
    ("fine.png", {"type": "models"}, 400),
    ("a" * 300 + ".png", {}, 400),
    ("fine.png", {"subfolder": "x/" * 2000}, 400),
])
def test_upload_refuses_names_out_of_its_folder(start_server, serve_settings, name, fields, status):
    url, _ = start_server()
    assert_refused(raw_multipart(url, f"filename=\"{name}\"", **fields), status)
    assert not (serve_settings.output_dir.parent / "escape.png").exists()


@pytest.mark.parametrize("disposition", ["filename=\"bad\x00.png\"", "filename*=UTF-8''bad%00.png"])
def test_upload_refuses_a_nul_byte_in_the_file_name(start_server, disposition):
    url, _ = start_server()
    assert_refused(raw_multipart(url, disposition), 400)


def test_upload_refuses_a_subfolder_that_links_out(start_server, serve_settings, tmp_path):
    url, _ = start_server()
    outside = tmp_path / "outside"
    outside.mkdir()
    input_folder = serve_settings.output_dir.parent / "input"
    input_folder.mkdir(parents=True)
    os.symlink(outside, input_folder / "linked")
    assert_refused(upload(url, "x.png", png_bytes(), subfolder="linked"), 403)
    assert list(outside.iterdir()) == []


def test_upload_into_a_subfolder_that_is_a_file_or_a_loop_is_400(start_server, serve_settings):
    url, _ = start_server()
    assert upload(url, "pic.png", png_bytes()).status == 200
    for subfolder in ("pic.png", "pic.png/deeper"):
        message = assert_refused(upload(url, "x.png", png_bytes(), subfolder=subfolder), 400)
        assert message.startswith(f"file 'x.png' in subfolder {subfolder!r} cannot be used: ")
    input_folder = serve_settings.output_dir.parent / "input"
    os.symlink(input_folder / "loop", input_folder / "loop")
    message = assert_refused(upload(url, "x.png", png_bytes(), subfolder="loop"), 400)
    assert message.startswith("file 'x.png' in subfolder 'loop' cannot be used: ")
    assert sorted(path.name for path in input_folder.iterdir()) == ["loop", "pic.png"]


def test_uploads_never_overwrite_outside_the_input_folder(start_server, serve_settings):
    url, _ = start_server()
    first = upload(url, "same.png", png_bytes((1, 2, 3, 255)), type="output", overwrite="true").json()
    second = upload(url, "same.png", png_bytes((4, 5, 6, 255)), type="output", overwrite="true").json()
    assert (first["name"], second["name"]) == ("same.png", "same (1).png")
    folder = serve_settings.output_dir
    assert Image.open(folder / "same.png").getpixel((0, 0)) == (1, 2, 3, 255)
    again = upload(url, "same.png", png_bytes((1, 2, 3, 255)), type="output").json()
    assert again["name"] == "same.png"  # the same bytes: the existing file, nothing new written
    assert sorted(path.name for path in folder.iterdir()) == ["same (1).png", "same.png"]


def test_overwrite_is_honoured_in_the_input_folder_only_and_replaces_links_not_targets(
        start_server, serve_settings, tmp_path):
    url, _ = start_server()
    input_folder = serve_settings.output_dir.parent / "input"
    upload(url, "pic.png", png_bytes((1, 1, 1, 255)))
    assert upload(url, "pic.png", png_bytes((2, 2, 2, 255))).json()["name"] == "pic (1).png"
    assert upload(url, "pic.png", png_bytes((3, 3, 3, 255)), overwrite="true").json()["name"] == "pic.png"
    assert Image.open(input_folder / "pic.png").getpixel((0, 0)) == (3, 3, 3, 255)
    target = tmp_path / "target.png"
    target.write_bytes(b"keep me")
    os.symlink(target, input_folder / "link.png")
    assert upload(url, "link.png", png_bytes()).json()["name"] == "link (1).png"  # no overwrite: a new name
    assert target.read_bytes() == b"keep me" and (input_folder / "link.png").is_symlink()
    assert upload(url, "link.png", png_bytes(), overwrite="true").status == 200
    assert target.read_bytes() == b"keep me" and not (input_folder / "link.png").is_symlink()


# -- body sizes --

def test_json_bodies_over_the_limit_are_refused(start_server):
    url, _ = start_server(max_json_bytes=1000)
    big = {"prompt": image_prompt(), "extra_data": {"padding": "x" * 2000}}
    assert_refused(request("POST", f"{url}/prompt", json=big), 413)

    async def chunked():  # no Content-Length: the limit holds while reading
        async def body():
            for _ in range(10):
                yield b" " * 500

        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/prompt", data=body()) as answer:
                return answer.status

    assert asyncio.run(chunked()) == 413


def test_uploads_over_the_limit_are_refused(start_server, serve_settings):
    url, _ = start_server(max_upload_bytes=10_000)
    assert_refused(upload(url, "big.png", b"\x89PNG" + b"0" * 20_000), 413)
    assert not (serve_settings.output_dir.parent / "input" / "big.png").exists()


def test_websocket_messages_over_the_limit_close_that_socket_only(start_server):
    url, _ = start_server()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=big") as ws:
                assert json.loads((await ws.receive()).data)["type"] == "status"
                await ws.send_str("x" * (WS_MAX_MESSAGE + 1))
                while (message := await ws.receive()).type == aiohttp.WSMsgType.TEXT:
                    pass
                return message.type, ws.close_code

    kind, code = asyncio.run(scenario())
    assert kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
    assert code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    assert request("GET", f"{url}/prompt").status == 200
    _, followed = asyncio.run(queue_and_follow(url, image_prompt(), client_id="big"))
    assert "execution_success" in followed.types()


# -- malformed bodies --

@pytest.mark.parametrize("path, body", [
    ("/prompt", b"{not json"),
    ("/prompt", b"[1, 2]"),
    ("/prompt", b""),
    ("/prompt", b"\xff\xfe"),
    ("/prompt", b"[" * 1000 + b"]" * 1000),
    ("/prompt", json.dumps({"prompt": "a string"}).encode()),
    ("/prompt", json.dumps({"prompt": {"1": "not a node"}}).encode()),
    ("/prompt", json.dumps({"prompt": {"1": {"class_type": "SaveImage", "inputs": []}}}).encode()),
    ("/prompt", json.dumps({"prompt": {"1": {"class_type": "SaveImage",
                                             "inputs": {"images": ["9", 0]}}}}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "client_id": 5}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "number": "first"}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "prompt_id": ""}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "prompt_id": "x" * 500}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "extra_data": []}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "partial_execution_targets": "2"}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "extra_data": {"preview_method": ["auto"]}}).encode()),
    ("/prompt", json.dumps({"prompt": image_prompt(), "extra_data": {"preview_method": "up"}}).encode()),
    ("/queue", json.dumps({"delete": "abc"}).encode()),
    ("/queue", json.dumps({"clear": "yes"}).encode()),
    ("/history", json.dumps({"delete": [1, 2]}).encode()),
    ("/history", b"nonsense"),
    ("/interrupt", json.dumps({"prompt_id": 5}).encode()),
    ("/free", json.dumps({"free_memory": 1}).encode()),
])
def test_malformed_json_bodies_are_400_with_a_message(start_server, path, body):
    url, _ = start_server()
    headers = {"Content-Type": "application/json"}
    assert_refused(request("POST", f"{url}{path}", data=body, headers=headers), 400)


@pytest.mark.parametrize("route, make", [
    ("image", lambda: b"just text"),
    ("image", lambda: aiohttp.FormData({"other": "field"})),
    ("mask", lambda: aiohttp.FormData({"image": "not a file"})),
])
def test_malformed_forms_are_400_with_a_message(start_server, route, make):
    url, _ = start_server()
    data = make()
    headers = {"Content-Type": "multipart/form-data; boundary=x"} if isinstance(data, bytes) else {}
    assert_refused(request("POST", f"{url}/upload/{route}", data=data, headers=headers), 400)


@pytest.mark.parametrize("original_ref, status", [
    (None, 400),
    ("{broken", 400),
    (json.dumps(["a list"]), 400),
    (json.dumps({"filename": "../../x.png", "type": "input"}), 400),
    (json.dumps({"filename": "x.png", "subfolder": "../..", "type": "input"}), 403),
    (json.dumps({"filename": "missing.png", "type": "input"}), 404),
])
def test_mask_uploads_check_their_original(start_server, original_ref, status):
    url, _ = start_server()
    fields = {} if original_ref is None else {"original_ref": original_ref}
    assert_refused(upload(url, "mask.png", png_bytes(), route="mask", **fields), status)


def test_mask_upload_that_is_not_an_image_is_400(start_server):
    url, _ = start_server()
    upload(url, "photo.png", png_bytes())
    ref = json.dumps({"filename": "photo.png", "type": "input"})
    assert_refused(upload(url, "mask.png", b"not an image", route="mask", original_ref=ref), 400)


def test_bad_query_values_are_400_and_the_server_keeps_serving(start_server):
    url, _ = start_server()
    assert_refused(request("GET", f"{url}/history", params={"max_items": "many"}), 400)
    assert_refused(request("GET", f"{url}/history", params={"max_items": "-3"}), 400)
    _, followed = asyncio.run(queue_and_follow(url, image_prompt()))
    ref = followed.of("executed")[0]["output"]["images"][0]
    assert_refused(request("GET", f"{url}/view", params={**ref, "channel": "cmyk"}), 400)
    assert request("GET", f"{url}/view", params=ref).status == 200
