"""ComfyUI's routes, with its paths, methods, JSON shapes and status codes, each also under /api.

    POST /prompt            {"prompt", "client_id"?, "prompt_id"?, "number"?, "front"?, "extra_data"?,
                             "partial_execution_targets"?} -> {"prompt_id", "number", "node_errors"}, or 400
                             {"error": {"type", "message", "details", "extra_info"}, "node_errors"}
    GET  /prompt            {"exec_info": {"queue_remaining"}}
    GET  /queue             {"queue_running": [[number, prompt_id, prompt, extra_data, outputs]],
                             "queue_pending": [...]}
    POST /queue             {"clear": true} / {"delete": [prompt_id, ...]}
    POST /interrupt         {} or {"prompt_id"}: stop the running prompt within a step
    GET  /history           ?max_items=&offset= -> {prompt_id: {"prompt", "outputs", "status", "meta"}}
    GET  /history/{id}      {prompt_id: entry} or {}
    POST /history           {"clear": true} / {"delete": [prompt_id, ...]}
    GET  /view              ?filename=&subfolder=&type=output|input|temp [&channel=rgb|a] [&preview=jpeg;90]
    POST /upload/image      multipart: image, overwrite?, type?, subfolder? -> {"name", "subfolder", "type"}
    POST /upload/mask       the same, plus original_ref (JSON {"filename", "subfolder", "type"})
    GET  /object_info       every node type (schema.py); /object_info/{node_class} one, or {}
    GET  /system_stats      {"system": {...}, "devices": [...]}
    GET  /models            the model folder kinds; /models/{folder} its files, or 404
    GET  /embeddings        the embeddings' names without extensions
    POST /free              {"unload_models"?, "free_memory"?}: drop cached results between prompts
    GET  /features          {"supports_preview_metadata": false, "max_upload_size"}
    GET  /ws                the websocket (server.py; answers a first {"type": "feature_flags"} message
                            with the server's flags, as ComfyUI does)

Where ComfyUI answers a bad request with an empty 400, Sluice adds a JSON body that says what was wrong.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import io
import math
import os
import platform
import sys
import uuid
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import http_exceptions, web
from PIL import Image, PngImagePlugin, UnidentifiedImageError

from app.server.files import FOLDER_TYPES, PathRefused, folder_of, save_upload, view_path
from app.server.prompts import PromptRejected, check_prompt, error_entry
from app.server.queue import QueueItem
from app.server.schema import node_info, object_info
from engine.devices import list_devices, memory_info
from engine.jsonfile import JsonInputError, load_json
from engine.settings import MODEL_FOLDERS, SettingsError
from nodes.conditioning import EMBEDDING_EXTENSIONS

if TYPE_CHECKING:
    from app.server.server import SluiceServer

PREVIEW_METHODS = {"default": None, "auto": "auto", "latent2rgb": "latent2rgb", "taesd": "taesd",
                   "none": "none"}  # ComfyUI's extra_data.preview_method -> Sluice's (None: the server's)
LEGACY_FOLDERS = {"unet": "diffusion_models", "clip": "text_encoders"}  # ComfyUI's old names
MAX_PROMPT_ID = 128  # characters


class RequestError(Exception):
    """A bad request: answered with `status` and ComfyUI's error shape."""

    def __init__(self, status: int, type_name: str, message: str, details: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": error_entry(type_name, message, details), "node_errors": {}}


def _version() -> str:
    try:
        return f"sluice-{importlib.metadata.version('sluice')}"
    except importlib.metadata.PackageNotFoundError:
        return "sluice"


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(400, "invalid_field", f"field {name!r} must be true or false, got {value!r}")
    return value


def _id_list(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RequestError(400, "invalid_field", f"field {name!r} must be a list of prompt ids (strings), "
                                                 f"got {value!r}")
    return value


class Routes:
    def __init__(self, server: SluiceServer) -> None:
        self.server = server
        self.settings = server.settings

    def add_to(self, app: web.Application) -> None:
        table = [
            ("GET", "/ws", self.server.websocket),
            ("GET", "/prompt", self.get_prompt), ("POST", "/prompt", self.post_prompt),
            ("GET", "/queue", self.get_queue), ("POST", "/queue", self.post_queue),
            ("POST", "/interrupt", self.post_interrupt),
            ("GET", "/history", self.get_history), ("GET", "/history/{prompt_id}", self.get_history_item),
            ("POST", "/history", self.post_history),
            ("GET", "/view", self.get_view),
            ("POST", "/upload/image", self.post_upload_image),
            ("POST", "/upload/mask", self.post_upload_mask),
            ("GET", "/object_info", self.get_object_info),
            ("GET", "/object_info/{node_class}", self.get_node_info),
            ("GET", "/system_stats", self.get_system_stats),
            ("GET", "/models", self.get_models), ("GET", "/models/{folder}", self.get_model_files),
            ("GET", "/embeddings", self.get_embeddings),
            ("POST", "/free", self.post_free),
            ("GET", "/features", self.get_features),
        ]
        for method, path, handler in table:
            app.router.add_route(method, path, handler)
            app.router.add_route(method, "/api" + path, handler)
        app.router.add_route("GET", "/", self.get_root)

    @staticmethod
    async def _blocking(function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(function, *args))

    async def _json_body(self, request: web.Request, optional: bool = False) -> dict[str, Any]:
        """The body as a JSON object, within the JSON size limit; RequestError (400, 413) otherwise."""
        limit = self.server.options.max_json_bytes
        too_large = RequestError(413, "request_too_large", f"the request body is larger than the limit of "
                                                           f"{limit} bytes for JSON")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks, total = [], 0
        async for chunk in request.content.iter_chunked(64 * 1024):
            total += len(chunk)
            if total > limit:
                raise too_large
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body.strip():
            if optional:
                return {}
            raise RequestError(400, "invalid_json", "the request body is empty; expected a JSON object")
        try:
            data = load_json(body, "the request body")
        except JsonInputError as error:
            raise RequestError(400, "invalid_json", str(error)) from None
        if not isinstance(data, dict):
            raise RequestError(400, "invalid_json", f"the request body must be a JSON object, got "
                                                    f"{type(data).__name__}")
        return data

    async def get_root(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "sluice", "version": _version(),
                                  "api": "ComfyUI's HTTP and websocket API; see /object_info and /ws"})

    # -- prompts and the queue --

    async def get_prompt(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.queue_info())

    async def post_prompt(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if "prompt" not in body:
            error = error_entry("no_prompt", "No prompt provided", "No prompt provided")
            return web.json_response({"error": error, "node_errors": {}}, status=400)
        queue = self.server.queue
        if "number" in body:
            number = body["number"]
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
                raise RequestError(400, "invalid_field", f"field 'number' must be a number, got {number!r}")
            number = float(number)
        else:
            number = queue.next_number(front=bool(body.get("front")))
        client_id = body.get("client_id")
        if client_id is not None and not isinstance(client_id, str):
            raise RequestError(400, "invalid_field", f"field 'client_id' must be a string, got {client_id!r}")
        prompt_id = body.get("prompt_id")
        if prompt_id is None:
            prompt_id = str(uuid.uuid4())
        elif isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)) or not str(prompt_id) \
                or len(str(prompt_id)) > MAX_PROMPT_ID or not str(prompt_id).isprintable():
            raise RequestError(400, "invalid_field", f"field 'prompt_id' must be printable text of 1 to "
                                                     f"{MAX_PROMPT_ID} characters, got {prompt_id!r}")
        extra_data = body.get("extra_data", {})
        if not isinstance(extra_data, dict):
            raise RequestError(400, "invalid_field", f"field 'extra_data' must be an object, got "
                                                     f"{extra_data!r}")
        targets = body.get("partial_execution_targets")
        if targets is not None and (not isinstance(targets, list)
                                    or not all(isinstance(target, str) for target in targets)):
            raise RequestError(400, "invalid_field", f"field 'partial_execution_targets' must be a list of "
                                                     f"node ids, got {targets!r}")
        extra_data = dict(extra_data)
        if client_id is not None:
            extra_data["client_id"] = client_id
        chosen = extra_data.get("preview_method", "default")
        if not isinstance(chosen, str) or chosen not in PREVIEW_METHODS:
            raise RequestError(400, "invalid_field", f"extra_data.preview_method {chosen!r} is not one of "
                                                     f"{', '.join(PREVIEW_METHODS)}")
        method = PREVIEW_METHODS[chosen] or self.server.options.preview_method
        try:
            checked = await self._blocking(check_prompt, body["prompt"], self.server.registry.get,
                                           self.settings, method, targets)
        except PromptRejected as rejected:
            return web.json_response({"error": rejected.error, "node_errors": rejected.node_errors},
                                     status=400)
        item = QueueItem(number, str(prompt_id), body["prompt"], extra_data, checked.outputs,
                         checked.workflow)
        try:
            queue.put(item)
        except ValueError as error:
            raise RequestError(400, "duplicate_prompt_id", str(error)) from None
        return web.json_response({"prompt_id": item.prompt_id, "number": number,
                                  "node_errors": checked.node_errors})

    async def get_queue(self, request: web.Request) -> web.Response:
        return web.json_response({"queue_running": [item.as_list() for item in self.server.queue.running()],
                                  "queue_pending": [item.as_list() for item in self.server.queue.pending()]})

    async def post_queue(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if _bool_field(body, "clear"):
            self.server.queue.clear_pending()
        if "delete" in body:
            self.server.queue.delete_pending(_id_list(body, "delete"))
        return web.Response(status=200)

    async def post_interrupt(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, optional=True)
        prompt_id = body.get("prompt_id")
        if prompt_id is not None and not isinstance(prompt_id, str):
            raise RequestError(400, "invalid_field", f"field 'prompt_id' must be a string, got {prompt_id!r}")
        self.server.engine.interrupt(prompt_id)
        return web.Response(status=200)

    async def get_history(self, request: web.Request) -> web.Response:
        numbers = {}
        for name, default in (("max_items", None), ("offset", -1)):
            text = request.query.get(name)
            try:
                numbers[name] = default if text is None else int(text)
            except ValueError:
                raise RequestError(400, "invalid_field",
                                   f"query {name}={text!r} is not a whole number") from None
        if numbers["max_items"] is not None and numbers["max_items"] < 0:
            raise RequestError(400, "invalid_field", f"query max_items={numbers['max_items']} is negative")
        return web.json_response(self.server.queue.history(numbers["max_items"], numbers["offset"]))

    async def get_history_item(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.queue.history_item(request.match_info["prompt_id"]))

    async def post_history(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if _bool_field(body, "clear"):
            self.server.queue.clear_history()
        if "delete" in body:
            self.server.queue.delete_history(_id_list(body, "delete"))
        return web.Response(status=200)

    async def post_free(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, optional=True)
        for name in ("unload_models", "free_memory"):
            if _bool_field(body, name):
                self.server.queue.set_flag(name, True)
        return web.Response(status=200)

    # -- files --

    async def get_view(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        if "filename" not in query:
            raise RequestError(404, "not_found", "no filename given; /view needs ?filename=NAME")
        try:
            path = view_path(query["filename"], query.get("subfolder", ""), query.get("type"), self.settings)
        except PathRefused as refused:
            raise RequestError(refused.status, "bad_path" if refused.status != 404 else "not_found",
                               refused.message) from None
        disposition = {"Content-Disposition": f"filename=\"{path.name.replace(chr(34), '')}\""}
        channel, preview = query.get("channel", ""), query.get("preview")
        if preview is None and channel in ("", "rgba"):
            return web.FileResponse(path, headers=disposition)
        if channel not in ("", "rgba", "rgb", "a"):
            raise RequestError(400, "invalid_field", f"channel {channel!r} is not one of rgba, rgb, a")
        try:
            body, content_type = await self._blocking(_converted_image, path, channel, preview)
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise RequestError(400, "not_an_image", f"cannot convert {path.name!r}: {error}") from None
        return web.Response(body=body, content_type=content_type, headers=disposition)

    async def _form(self, request: web.Request) -> Any:
        try:
            return await request.post()
        except web.HTTPRequestEntityTooLarge:
            raise
        except (ValueError, AssertionError, UnicodeError, http_exceptions.HttpProcessingError) as error:
            raise RequestError(400, "invalid_form", f"the request is not a readable multipart form: "
                                                    f"{error}") from None

    async def _upload(self, request: web.Request, mask: bool) -> web.Response:
        form = await self._form(request)
        image = form.get("image")
        if not isinstance(image, web.FileField):
            raise RequestError(400, "invalid_form", "the form has no file in field 'image'")
        type_name = form.get("type") or "input"
        subfolder = form.get("subfolder") or ""
        if not isinstance(type_name, str) or type_name not in FOLDER_TYPES:
            raise RequestError(400, "invalid_field",
                               f"type {type_name!r} is not one of {', '.join(FOLDER_TYPES)}")
        if not isinstance(subfolder, str):
            raise RequestError(400, "invalid_field", "subfolder must be text")
        overwrite = form.get("overwrite") in ("true", "1") and type_name == "input"
        data = image.file.read()
        try:
            if mask:
                data = await self._masked(self._original_ref(form), data)
            name = await self._blocking(save_upload, folder_of(type_name, self.settings), subfolder,
                                        image.filename or "", data, overwrite)
        except PathRefused as refused:
            raise RequestError(refused.status, "bad_path", refused.message) from None
        return web.json_response({"name": name, "subfolder": subfolder, "type": type_name})

    async def _masked(self, ref: dict[str, Any], mask_bytes: bytes) -> bytes:
        try:
            return await self._blocking(_masked_original, ref, mask_bytes, self.settings)
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise RequestError(400, "not_an_image",
                               f"cannot read the mask or its original: {error}") from None

    @staticmethod
    def _original_ref(form: Any) -> dict[str, Any]:
        text = form.get("original_ref")
        if not isinstance(text, str):
            raise RequestError(400, "invalid_form", "the form has no field 'original_ref' (JSON "
                                                    "{\"filename\", \"subfolder\", \"type\"})")
        try:
            ref = load_json(text, "original_ref")
        except JsonInputError as error:
            raise RequestError(400, "invalid_form", str(error)) from None
        fields = ((ref.get(key, default) if isinstance(ref, dict) else None)
                  for key, default in (("filename", None), ("subfolder", ""), ("type", "output")))
        if not all(isinstance(value, str) for value in fields):
            raise RequestError(400, "invalid_form", f"original_ref must be an object with a string filename "
                                                    f"(and subfolder, type), got {ref!r}")
        return ref

    async def post_upload_image(self, request: web.Request) -> web.Response:
        return await self._upload(request, mask=False)

    async def post_upload_mask(self, request: web.Request) -> web.Response:
        return await self._upload(request, mask=True)

    # -- catalogue and system --

    async def get_object_info(self, request: web.Request) -> web.Response:
        return web.json_response(await self._blocking(object_info, self.server.registry, self.settings))

    async def get_node_info(self, request: web.Request) -> web.Response:
        name = request.match_info["node_class"]
        node_type = self.server.registry.get(name)
        if node_type is None:
            return web.json_response({})
        info = await self._blocking(node_info, node_type, self.settings, self.server.registry.source_of(name))
        return web.json_response({name: info})

    async def get_system_stats(self, request: web.Request) -> web.Response:
        devices = []
        for device in list_devices():
            total, free = memory_info(device)
            devices.append({"name": device.description, "type": device.torch_device.type,
                            "index": device.torch_device.index, "vram_total": total, "vram_free": free,
                            "torch_vram_total": total, "torch_vram_free": free})
        ram_total, ram_free = memory_info("cpu")
        return web.json_response({
            "system": {"os": os.name, "ram_total": ram_total, "ram_free": ram_free,
                       "comfyui_version": _version(), "python_version": sys.version,
                       "pytorch_version": torch.__version__,
                       "embedded_python": False, "argv": sys.argv, "platform": platform.platform()},
            "devices": devices})

    async def get_models(self, request: web.Request) -> web.Response:
        return web.json_response(list(MODEL_FOLDERS))

    async def get_model_files(self, request: web.Request) -> web.Response:
        folder = request.match_info["folder"]
        kind = LEGACY_FOLDERS.get(folder, folder)
        if kind not in MODEL_FOLDERS:
            raise RequestError(404, "not_found", f"unknown model folder {folder!r}; known: "
                                                 f"{', '.join(MODEL_FOLDERS)}")
        try:
            return web.json_response(await self._blocking(self.settings.list_models, kind))
        except SettingsError as error:
            raise RequestError(404, "not_found", str(error)) from None

    async def get_embeddings(self, request: web.Request) -> web.Response:
        names = await self._blocking(self.settings.list_models, "embeddings", EMBEDDING_EXTENSIONS)
        return web.json_response([os.path.splitext(name)[0] for name in names])

    async def get_features(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.features())


def _converted_image(path: Any, channel: str, preview: str | None) -> tuple[bytes, str]:
    """/view's conversions: the RGB or alpha channel as PNG, or a JPEG/WebP preview ('webp;90')."""
    with Image.open(path) as image:
        image.load()
        if preview is not None:
            parts = preview.split(";")
            image_format = parts[0] if parts[0] in ("webp", "jpeg") and "a" not in channel else "webp"
            quality = int(parts[-1]) if parts[-1].isdigit() else 90
            if image_format == "jpeg" or channel == "rgb":
                image = image.convert("RGB")
            buffer = io.BytesIO()
            image.save(buffer, format=image_format.upper(), quality=min(quality, 100))
            return buffer.getvalue(), f"image/{image_format}"
        if channel == "rgb":
            converted = image.convert("RGB")
        else:
            alpha = image.getchannel("A") if image.mode == "RGBA" else Image.new("L", image.size, 255)
            converted = Image.new("RGBA", image.size)
            converted.putalpha(alpha)
        buffer = io.BytesIO()
        converted.save(buffer, format="PNG")
        return buffer.getvalue(), "image/png"


def _masked_original(ref: dict[str, Any], mask_bytes: bytes, settings: Any) -> bytes:
    """ComfyUI's mask upload: the original image (original_ref, checked like /view) with the mask's alpha."""
    original_path = view_path(ref["filename"], ref.get("subfolder", ""), ref.get("type", "output"), settings)
    with Image.open(original_path) as original, Image.open(io.BytesIO(mask_bytes)) as mask:
        text = dict(getattr(original, "text", {}))
        combined = original.convert("RGBA")
        alpha = mask.convert("RGBA").getchannel("A")
        if alpha.size != combined.size:
            raise ValueError(f"the mask is {alpha.size[0]}x{alpha.size[1]} but the original is "
                             f"{combined.size[0]}x{combined.size[1]}")
        combined.putalpha(alpha)
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(str(key), str(value))
    buffer = io.BytesIO()
    combined.save(buffer, format="PNG", pnginfo=info, compress_level=4)
    return buffer.getvalue()
