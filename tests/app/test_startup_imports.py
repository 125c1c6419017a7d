"""Start-up imports (issue 21): the node registry and a headless run import no heavy optional library, and
`sluice run` works without spandrel installed until an upscaler node runs, which then names the package.

Each check runs in a fresh interpreter, where `sys.modules['spandrel'] = None` makes `import spandrel` fail
as if the package were not installed."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file
from spandrel.architectures.ESRGAN import ESRGAN

from engine.graph.document import Workflow
from engine.settings import resources_dir

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("spandrel", "torchvision", "diffusers", "transformers", "PySide6")
WITHOUT_SPANDREL = "import sys; sys.modules['spandrel'] = None\n"


def python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def cli_without_spandrel(*argv: str) -> subprocess.CompletedProcess:
    """`sluice ARGV` in a fresh interpreter without spandrel; its last stdout line is the imported modules."""
    return python(WITHOUT_SPANDREL + "import json\nfrom app.cli import main\n"
                  f"code = main({list(argv)!r})\n"
                  "print(json.dumps(sorted(n for n, m in sys.modules.items() if m is not None)))\n"
                  "raise SystemExit(code)\n")


def test_building_the_default_registry_imports_no_heavy_library():
    result = python("import json, sys\n"
                    "from nodes.registry import default_registry\n"
                    "from engine.graph import executor\n"
                    "registry = default_registry()\n"
                    "assert registry.get('UpscaleModelLoader') is not None\n"
                    "print(json.dumps(sorted(sys.modules)))")
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_default_workflow_runs_headless_without_spandrel(tmp_path):
    result = cli_without_spandrel("--models", str(tmp_path / "models"), "--output", str(tmp_path / "out"),
                                  "--headless", "--quiet")
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "out").glob("*.png"))) == 1
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert loaded.isdisjoint(HEAVY + ("torch._dynamo",)), sorted(loaded & set(HEAVY + ("torch._dynamo",)))


def test_building_the_text_encoders_and_flux_does_not_import_dynamo():
    """nn.Embedding's random initialisation imports torch._dynamo (1-2 s); the text encoders skip it."""
    result = python("import sys\n"
                    "from engine.models.clip import CLIPTextModel, clip_l_config, openclip_bigg_config\n"
                    "CLIPTextModel(clip_l_config(), layout='hf', device='meta')\n"
                    "CLIPTextModel(openclip_bigg_config(), layout='open_clip', device='meta')\n"
                    "from engine.models.t5 import T5Encoder, t5_xxl_config\n"
                    "from engine.models.flux import FluxTransformer, flux_dev_config\n"
                    "T5Encoder(t5_xxl_config(), device='meta')\n"
                    "FluxTransformer(flux_dev_config(), device='meta')\n"
                    "print('torch._dynamo' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


def test_nodes_lists_the_upscaler_nodes_without_spandrel(tmp_path):
    (tmp_path / "models" / "upscale_models").mkdir(parents=True)
    (tmp_path / "models" / "upscale_models" / "x2.pth").write_bytes(b"")
    result = cli_without_spandrel("--models", str(tmp_path / "models"), "nodes", "--json")
    assert result.returncode == 0, result.stderr
    assert "UpscaleModelLoader" in result.stdout and "x2.pth" in result.stdout


def test_upscaler_node_without_spandrel_fails_naming_the_package(tmp_path):
    models = tmp_path / "models"
    (models / "upscale_models").mkdir(parents=True)
    network = ESRGAN(num_filters=8, num_blocks=1, scale=2)
    save_file({k: v.contiguous() for k, v in network.state_dict().items()},
              str(models / "upscale_models" / "tiny_x2.safetensors"))
    workflow = Workflow.load(resources_dir() / "workflows" / "default.json")
    decode = next(i for i, n in workflow.nodes.items() if n.type == "VAEDecode")
    save = next(i for i, n in workflow.nodes.items() if n.type == "SaveImage")
    loader = workflow.add_node("UpscaleModelLoader", {"model_name": "tiny_x2.safetensors"})
    upscale = workflow.add_node("ImageUpscaleWithModel")
    workflow.connect(loader.id, 0, upscale.id, "upscale_model", "UPSCALE_MODEL")
    workflow.connect(decode, 0, upscale.id, "image", "IMAGE")
    workflow.connect(upscale.id, 0, save, "images", "IMAGE")
    workflow.save(tmp_path / "upscale.json")

    result = cli_without_spandrel("--models", str(models), "--output", str(tmp_path / "out"),
                                  "run", str(tmp_path / "upscale.json"), "--quiet")
    assert result.returncode == 1, result.stderr
    assert "UpscaleModelLoader" in result.stderr
    assert "'spandrel', which is not installed" in result.stderr
    assert "pip install spandrel" in result.stderr
    assert not list((tmp_path / "out").glob("*.png"))

