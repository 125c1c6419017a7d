"""VAE decode and encode (whole and tiled) stop at the next block once a job is interrupted, with the embedded
model's VAE under the memory runtime; the hooks that check leave the result unchanged and are removed."""

import pytest
import torch

from engine.graph.errors import Interrupted
from engine.graph.spec import RunContext
from engine.models.vae import ResnetBlock
from engine.settings import Settings
from nodes.latent import INTERRUPT_POINTS, VAEDecode, VAEDecodeTiled, VAEEncode, VAEEncodeTiled
from nodes.loaders import CheckpointLoaderSimple

LATENT = {"samples": torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))}  # 2 x 128x128
PIXELS = torch.rand(1, 128, 128, 3, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    settings = Settings(models_root=folder / "models", output_dir=folder / "out", plugins_dir=None)
    return CheckpointLoaderSimple().run(RunContext("1", settings=settings),
                                        ckpt_name="sluice-shapes.safetensors")[2]


class InterruptAfter:
    """A job's interrupt flag, set (as Ctrl+C would) when the VAE's `after`-th resnet block starts; counts the
    resnet blocks that run once it is set."""

    def __init__(self, vae, after: int) -> None:
        self.after, self.started, self.flag, self.ran_after = after, 0, False, 0
        self.handles = [m.register_forward_pre_hook(self.on_block) for m in vae.autoencoder.modules()
                        if isinstance(m, ResnetBlock)]

    def on_block(self, module, args) -> None:
        self.started += 1
        if self.flag:
            self.ran_after += 1
        if self.started == self.after:
            self.flag = True

    def check(self) -> None:
        if self.flag:
            raise Interrupted("the job was interrupted")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _run(node, vae, check, **widgets):
    ctx = RunContext("7", check_interrupt=check)
    if isinstance(node, (VAEDecode, VAEDecodeTiled)):
        return node.run(ctx, samples=LATENT, vae=vae, **widgets)
    return node.run(ctx, pixels=PIXELS, vae=vae, **widgets)


@pytest.mark.parametrize(("node", "widgets"), [
    (VAEDecode(), {}), (VAEDecodeTiled(), {"tile_size": 64, "overlap": 16}),
    (VAEEncode(), {}), (VAEEncodeTiled(), {"tile_size": 64, "overlap": 16}),
])
def test_an_interrupt_stops_the_vae_at_the_next_block(vae, node, widgets):
    spy = InterruptAfter(vae, after=3)
    try:
        with pytest.raises(Interrupted):
            _run(node, vae, spy.check, **widgets)
    finally:
        spy.remove()
    assert spy.started == 3 and spy.ran_after == 0  # the block that saw the flag set was the last to start
    assert all(not m._forward_pre_hooks for m in vae.autoencoder.modules() if isinstance(m, INTERRUPT_POINTS))


def test_the_checks_change_nothing_and_go_away(vae):
    calls = []
    latent = LATENT["samples"][:1, :, :8, :8]
    expected = vae.decode(latent)
    ctx = RunContext("7", check_interrupt=lambda: calls.append(1))
    [image] = VAEDecode().run(ctx, {"samples": latent}, vae)
    assert torch.equal(image, expected)
    assert len(calls) == sum(isinstance(m, INTERRUPT_POINTS) for m in vae.autoencoder.decoder.modules())
    assert all(not m._forward_pre_hooks for m in vae.autoencoder.modules())
