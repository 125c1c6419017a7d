"""Inpainting in the sampler, as ComfyUI: the latent's noise mask and the extra inputs of inpainting UNets.

A LATENT's "noise_mask" (SetLatentNoiseMask, VAEEncodeForInpaint, InpaintModelConditioning) is 1 where the
sampler may change the latent and 0 where it must keep it; values between blend.

- `latent_noise_mask`: ComfyUI's reshape_mask. The mask, (B', 1, H, W) or (B', H, W) at any size (usually
  pixels), resized bilinearly to the latent's (h, w), repeated over its channels and to its batch.
- `InpaintDenoiser`: ComfyUI's KSamplerX0Inpaint around the guided denoiser. Before every model call the
  sample outside the mask is replaced by the original latent noised to the current sigma with the job's
  noise (the model sampling's noise_scaling); the prediction outside the mask is the original latent. So a
  sampler that ends on a prediction leaves the masked-out latent as it was.
- `inpaint_concat`: the 5 extra input channels of a 9-channel inpainting UNet (ComfyUI's concat_cond with
  the keys mask, masked_image): the mask, rounded, at latent size, then the masked image's latent, both in
  the model's space. Without any mask: a mask of ones and the latent of a blank image.
"""

import math

import torch

from engine.resize import resize

# Per channel, the latent ComfyUI gives an inpainting UNet that has no masked image (blank_inpaint_image_like,
# "zero in pixel space translated to latent space"), used as it is in the model's space.
BLANK_INPAINT_LATENT = (0.8223, -0.6876, 0.6364, 0.1380)
INPAINT_CONCAT_CHANNELS = 5  # mask + a 4-channel masked-image latent


def repeat_to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """The first `batch` items of the batch repeated as often as needed (ComfyUI's repeat_to_batch_size)."""
    if tensor.shape[0] == batch:
        return tensor
    repeats = math.ceil(batch / tensor.shape[0])
    return tensor.repeat(repeats, *[1] * (tensor.ndim - 1))[:batch]


def resize_to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """`batch` items picked evenly from the batch (ComfyUI's resize_to_batch_size): a batch of 2 made 4 is
    items 0, 0, 1, 1; made 1 it is item 0."""
    size = tensor.shape[0]
    if size == batch:
        return tensor
    if batch <= 1:
        return tensor[:batch]
    if batch < size:
        scale = (size - 1) / (batch - 1)
        picks = [min(round(i * scale), size - 1) for i in range(batch)]
    else:
        picks = [min(math.floor((i + 0.5) * size / batch), size - 1) for i in range(batch)]
    return tensor[picks]


def latent_noise_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A noise mask (B', 1, H, W) or (B', H, W) as the (B, C, h, w) mask of a latent of `shape`."""
    if mask.ndim not in (2, 3, 4) or (mask.ndim == 4 and mask.shape[1] != 1):
        raise ValueError(f"a noise mask must be (batch, 1, height, width), (batch, height, width) or "
                         f"(height, width); got shape {tuple(mask.shape)}")
    batch, channels, height, width = shape
    mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]).float()
    mask = torch.nn.functional.interpolate(mask, size=(height, width), mode="bilinear")
    return repeat_to_batch(mask.repeat(1, channels, 1, 1), batch)  # (B, C, h, w)


class InpaintDenoiser:
    """ComfyUI's KSamplerX0Inpaint: a denoiser that samples only where `mask` is 1.

    latent (B, C, h, w): the original latent in the model's space; noise: the job's unit noise (zeros when
    the job adds none); mask (B, C, h, w): latent_noise_mask's. CFG++ samplers reach the wrapped denoiser's
    unconditional prediction, unblended, as ComfyUI's post-CFG hook sees it.
    """

    def __init__(self, model, latent: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor):
        self.model, self.latent, self.noise, self.mask = model, latent, noise, mask
        self.model_sampling = model.model_sampling

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra_args: object) -> torch.Tensor:
        keep = 1.0 - self.mask
        sigma = torch.as_tensor(sigma, device=x.device).expand(x.shape[0])  # (B,)
        noised = self.model_sampling.noise_scaling(sigma, self.noise, self.latent)
        x = x * self.mask + noised * keep
        return self.model(x, sigma, **extra_args) * self.mask + self.latent * keep

    @property
    def keep_uncond(self) -> bool:  # CFG++ (guidance.py): forwarded to the guided denoiser
        return self.model.keep_uncond

    @keep_uncond.setter
    def keep_uncond(self, value: bool) -> None:
        self.model.keep_uncond = value

    @property
    def last_uncond_denoised(self) -> torch.Tensor:
        return self.model.last_uncond_denoised


def inpaint_concat(noise_shape: torch.Size | tuple[int, ...], latent: torch.Tensor,
                   noise_mask: torch.Tensor | None, concat_latent: torch.Tensor | None = None,
                   concat_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, 5, h, w) extra input of an inpainting UNet sampling a latent of `noise_shape`, in the model's
    space: [mask, masked-image latent].

    The mask is `concat_mask` (InpaintModelConditioning's, any size), else the job's `noise_mask`
    (latent_noise_mask's, its first channel); the masked image is `concat_latent` (InpaintModelConditioning's,
    already in the model's space), else the sampled `latent` itself. Both are resized bilinearly (centre
    crop to the aspect) to (h, w) and picked evenly to the batch; the mask is rounded to 0 or 1.
    """
    batch, _, height, width = noise_shape
    image = latent if concat_latent is None else concat_latent
    if tuple(image.shape[1:]) != tuple(noise_shape[1:]):
        image = resize(image, width, height, "bilinear", "center")
    image = resize_to_batch(image, batch)
    mask = noise_mask if concat_mask is None else concat_mask
    if mask is None:
        blank = torch.tensor(BLANK_INPAINT_LATENT, dtype=latent.dtype, device=latent.device)
        return torch.cat([torch.ones(batch, 1, height, width, dtype=latent.dtype, device=latent.device),
                          blank.reshape(1, -1, 1, 1).expand(batch, -1, height, width)], dim=1)
    if mask.ndim == len(noise_shape):
        mask = mask[:, :1]
    mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])
    if tuple(mask.shape[-2:]) != (height, width):
        mask = resize(mask, width, height, "bilinear", "center")
    mask = resize_to_batch(mask.round(), batch)
    return torch.cat([mask.to(image), image], dim=1)  # (B, 1 + C, h, w)
