"""`sluice run` on a txt2img-then-upscale workflow: the default workflow with a model upscale (a tiny
random-weight ESRGAN from the models folder) between the VAE decode and the save."""

import json

import torch
from PIL import Image
from safetensors.torch import save_file
from spandrel.architectures.ESRGAN import ESRGAN

from app.cli import main
from engine.graph.document import Workflow
from engine.settings import resources_dir


def test_txt2img_then_model_upscale_runs_from_the_command_line(tmp_path, capsys):
    models = tmp_path / "models"
    (models / "upscale_models").mkdir(parents=True)
    torch.manual_seed(0)
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
    path = tmp_path / "txt2img_upscale.json"
    workflow.save(path)

    code = main(["--models", str(models), "--output", str(tmp_path / "out"), "run", str(path), "--quiet"])
    assert code == 0, capsys.readouterr().err
    (saved,) = sorted((tmp_path / "out").glob("*.png"))
    image = Image.open(saved)
    assert image.size == (256, 256)  # the embedded model's 128 px, upscaled 2x
    embedded = json.loads(image.text["workflow"])  # the PNG carries the workflow that made it
    assert {n["type"] for n in embedded["nodes"]} >= {"UpscaleModelLoader", "ImageUpscaleWithModel"}
