"""Ctrl+C on `sluice run`, sent as SIGINT to a real process: during start-up it exits 130 at once without a
traceback; during a job the first one stops it at the next step or block (the VAE decode of the embedded
model included) and a second one exits 130 at once, even while a node sits in a long call."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.cli import default_workflow_path
from engine.graph.document import Workflow

ROOT = Path(__file__).resolve().parents[2]

SLOW_START = """
import os
import time

open(os.environ["SLUICE_TEST_MARKER"], "w").close()  # start-up reached the plugins
time.sleep(30)
NODE_TYPES = ()
"""

STUBBORN = """
import os
import time

from engine.graph.spec import NodeType


class Stubborn(NodeType):
    category = "test/interrupts"
    output_node = True

    def run(self, ctx):
        open(os.environ["SLUICE_TEST_MARKER"], "w").close()
        time.sleep(30)  # a long call that never checks for an interrupt
        return ()


NODE_TYPES = (Stubborn,)
"""

INTERRUPT_IN_DECODE = """
import atexit
import os
import signal
import sys
import time

import torch

from engine.models.vae import AutoencoderKL, ResnetBlock

seen = {"decoder blocks": 0, "after": 0}
build_decoder_stages = AutoencoderKL.decoder_stages


def decoder_stages(self):
    for block in self.decoder.modules():
        block.in_decoder = True
    return build_decoder_stages(self)


def on_block(module, args):
    if isinstance(module, ResnetBlock) and getattr(module, "in_decoder", False):
        seen["decoder blocks"] += 1
        if seen["decoder blocks"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl+C in the middle of the decode
            time.sleep(0.5)  # the block takes a while: the main thread's handler runs meanwhile
        elif seen["decoder blocks"] > 3:
            seen["after"] += 1


AutoencoderKL.decoder_stages = decoder_stages
torch.nn.modules.module.register_module_forward_pre_hook(on_block)
atexit.register(lambda: print(f"decoder blocks: {seen['decoder blocks']}, after the interrupt: "
                              f"{seen['after']}", file=sys.stderr))
NODE_TYPES = ()
"""


DUMP_ON_SIGUSR1 = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


def start(tmp_path: Path, plugin: str, workflow: Path, *args: str) -> subprocess.Popen:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "test_plugin.py").write_text(DUMP_ON_SIGUSR1 + textwrap.dedent(plugin), encoding="utf-8")
    env = {**os.environ, "SLUICE_SETTINGS": str(tmp_path / "no-settings.json"),
           "SLUICE_TEST_MARKER": str(tmp_path / "marker"), "SLUICE_CACHE": "off"}
    for name in ("SLUICE_MODELS", "SLUICE_OUTPUT", "SLUICE_PLUGINS"):
        env.pop(name, None)
    command = [sys.executable, "-m", "app", "--plugins", str(plugins), "--models", str(tmp_path / "models"),
               "--output", str(tmp_path / "out"), "run", str(workflow), *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the process never got there"
        time.sleep(0.02)


def stop(process: subprocess.Popen) -> tuple[int, str, float]:
    """Wait for the process; its exit code, stderr and the seconds it took to exit."""
    started = time.monotonic()
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)  # the plugin's faulthandler prints every thread's stack
        time.sleep(1)
        process.kill()
        raise AssertionError(f"no exit within 20 s: {process.communicate()[1]}") from None
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, time.monotonic() - started


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_during_start_up_exits_130_at_once_without_a_traceback(tmp_path):
    process = start(tmp_path, SLOW_START, default_workflow_path())
    wait_for(tmp_path / "marker", process)
    process.send_signal(signal.SIGINT)
    code, err, seconds = stop(process)
    assert code == 130 and seconds < 2
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.rstrip().endswith("sluice: interrupted")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_a_second_ctrl_c_exits_130_at_once_while_a_node_sits_in_a_long_call(tmp_path):
    workflow = Workflow()
    workflow.add_node("Stubborn", {})
    workflow.save(tmp_path / "stubborn.json")
    process = start(tmp_path, STUBBORN, tmp_path / "stubborn.json")
    wait_for(tmp_path / "marker", process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert process.poll() is None  # the first asks the job to stop; this node does not listen
    process.send_signal(signal.SIGINT)
    code, err, seconds = stop(process)
    assert code == 130 and seconds < 2
    assert "interrupting (Ctrl+C again to abort)" in err and "Traceback" not in err


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_during_the_vae_decode_of_the_embedded_model_stops_it_at_the_next_block(tmp_path):
    process = start(tmp_path, INTERRUPT_IN_DECODE, default_workflow_path(), "--set", "6.steps=1")
    code, err, _ = stop(process)
    assert code == 130, err
    assert "job interrupted" in err and "Traceback" not in err
    assert "decoder blocks: 3, after the interrupt: 0" in err
    assert not list((tmp_path / "out").glob("**/*.png"))  # nothing saved
