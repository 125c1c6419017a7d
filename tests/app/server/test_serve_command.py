"""The `sluice serve` command (issue 18 point 1): it binds 127.0.0.1 unless --listen says otherwise, serves
prompts into --output with the models of --models, stops on SIGTERM, gives every prompt the memory flags of
`sluice run`, and refuses bad flags before it listens."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from serve_client import image_prompt, request

import app.server.main as serve_main
from app.cli import main
from engine.memory.runtime import MemoryRuntime, get_runtime, set_runtime

ROOT = Path(__file__).resolve().parents[3]
SERVING = re.compile(r"serving ComfyUI's API on http://(\S+):(\d+) \(models (.+), output (.+)\)")


def wait_until(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_sluice_serve_binds_loopback_serves_into_its_folders_and_stops_on_sigterm(tmp_path):
    models, output = tmp_path / "models", tmp_path / "output"
    (models / "checkpoints").mkdir(parents=True)
    (models / "checkpoints" / "mine.safetensors").write_bytes(b"{}")
    (tmp_path / "empty-settings.json").write_text("{}", encoding="utf-8")  # the defaults, without a warning
    env = {**os.environ, "SLUICE_SETTINGS": str(tmp_path / "empty-settings.json"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_AUTH_TOKEN", None)
    process = subprocess.Popen([sys.executable, "-m", "app", "--models", str(models), "--output", str(output),
                                "serve", "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        match = SERVING.search(line)
        assert match, line
        host, port = match.group(1), int(match.group(2))
        assert host == "127.0.0.1"
        assert (match.group(3), match.group(4)) == (str(models), str(output))
        listening = {c.laddr for c in psutil.Process(process.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", port)}
        url = f"http://127.0.0.1:{port}"
        assert "mine.safetensors" in request("GET", f"{url}/models/checkpoints").json()
        prompt_id = request("POST", f"{url}/prompt", json={"prompt": image_prompt(prefix="served")}).json()[
            "prompt_id"]
        entry = wait_until(lambda: request("GET", f"{url}/history/{prompt_id}").json().get(prompt_id))
        (image,) = entry["outputs"]["2"]["images"]
        assert (output / image["filename"]).is_file() and image["filename"].startswith("served_")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert "sluice: stopping" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


@pytest.fixture
def fresh_runtime():
    previous = set_runtime(MemoryRuntime())
    yield
    set_runtime(previous)


def test_serve_gives_every_prompt_the_memory_flags_and_its_folders(tmp_path, monkeypatch, fresh_runtime):
    started = {}

    async def record(server, hosts, port):
        started.update(server=server, hosts=hosts, port=port)
        return 0

    monkeypatch.setattr(serve_main, "_serve_until_stopped", record)
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))
    monkeypatch.delenv("SLUICE_AUTH_TOKEN", raising=False)
    assert main(["serve", "--models", str(tmp_path / "m"), "--output", str(tmp_path / "o"), "--port", "9999",
                 "--max-vram", "6", "--vae-tiling", "on", "--listen", "127.0.0.1,::1"]) == 0
    server = started["server"]
    assert (started["hosts"], started["port"]) == (["127.0.0.1", "::1"], 9999)
    assert (server.settings.models_root, server.settings.output_dir) == (tmp_path / "m", tmp_path / "o")
    assert server.options.auth_token is None and server.options.max_upload_bytes == 100 * 1024 * 1024
    assert get_runtime().overrides == {"max_vram": "6", "vae_tiling": "on"}  # what every loader runs under

    monkeypatch.setenv("SLUICE_AUTH_TOKEN", "from-env")
    assert main(["serve", "--listen", "0.0.0.0", "--max-upload-size", "2"]) == 0  # a token: allowed
    assert started["server"].options.auth_token == "from-env"
    assert started["server"].options.max_upload_bytes == 2 * 1024 * 1024
    monkeypatch.delenv("SLUICE_AUTH_TOKEN")
    assert main(["serve", "--listen", "0.0.0.0", "--insecure"]) == 0
    assert started["hosts"] == ["0.0.0.0"] and started["server"].options.auth_token is None


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port 70000 is not a port number (0 to 65535)"),
    (["--max-upload-size", "0"], "--max-upload-size 0 must be a positive number of MB"),
    (["--max-upload-size", "nan"], "--max-upload-size nan must be a positive number of MB"),
    (["--max-upload-size", "inf"], "--max-upload-size inf must be a positive number of MB"),
    (["--listen", ","], "--listen names no address"),
    (["--listen", "10.1.2.3"], "refusing to start: --listen 10.1.2.3 would let anyone on the network"),
    (["--max-vram", "lots"], "invalid memory flag"),
])
def test_serve_refuses_bad_flags_before_it_listens(flags, message, tmp_path, monkeypatch, capsys,
                                                   fresh_runtime):
    async def never(*args):
        raise AssertionError("the server started")

    monkeypatch.setattr(serve_main, "_serve_until_stopped", never)
    monkeypatch.setenv("SLUICE_SETTINGS", str(tmp_path / "no-settings.json"))
    monkeypatch.delenv("SLUICE_AUTH_TOKEN", raising=False)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
