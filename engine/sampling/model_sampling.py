"""How a diffusion model's timesteps map to noise levels, and how its output becomes a denoised x0.

Everything here follows the k-diffusion convention (Karras et al. 2022, "Elucidating the Design Space
of Diffusion-Based Generative Models"): a sample at noise level sigma is `x = x0 + sigma * noise`, and a
denoiser maps `(x, sigma)` to an estimate of `x0`. `Denoiser` turns a UNet-style network (which sees a
scaled input and an integer-like timestep) into such a denoiser.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def scaled_linear_betas(linear_start: float = 0.00085, linear_end: float = 0.012,
                        timesteps: int = 1000) -> torch.Tensor:
    """The "scaled linear" beta schedule of Stable Diffusion (LDM): linear in sqrt(beta)."""
    return torch.linspace(linear_start ** 0.5, linear_end ** 0.5, timesteps, dtype=torch.float64) ** 2


ZSNR_LAST_ALPHA_CUMPROD = 4.8973451890853435e-08  # ComfyUI's stand-in for 0, which has no finite sigma


def rescale_zero_terminal_snr_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """Sigmas of the schedule shifted to zero terminal SNR (Lin et al. 2024, "Common Diffusion Noise Schedules
    and Sample Steps are Flawed", Algorithm 1) as ComfyUI: sqrt(alpha_bar) shifted so its last value is 0 and
    scaled so its first is kept; the last alpha_bar is then ZSNR_LAST_ALPHA_CUMPROD."""
    root = (1 / (sigmas * sigmas + 1)).sqrt()  # sqrt(alpha_bar), (T,)
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * (first / (first - last))
    alphas_cumprod = root ** 2
    alphas_cumprod[-1] = ZSNR_LAST_ALPHA_CUMPROD
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


class DiscreteSchedule:
    """A discrete-time VP schedule (DDPM) seen as a table of k-diffusion sigmas, one per timestep."""

    def __init__(self, betas: torch.Tensor | None = None, linear_start: float = 0.00085,
                 linear_end: float = 0.012, timesteps: int = 1000, quantize: bool = True, zsnr: bool = False):
        if betas is None:
            betas = scaled_linear_betas(linear_start, linear_end, timesteps)
        betas = torch.as_tensor(betas, dtype=torch.float64)
        if betas.ndim != 1 or len(betas) < 2 or not bool(((betas > 0) & (betas < 1)).all()):
            raise ValueError(f"betas must be a 1-D tensor of at least 2 values in (0, 1); got shape "
                             f"{tuple(betas.shape)}")
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        sigmas = ((1 - alphas_cumprod) / alphas_cumprod).sqrt()  # (T,) ascending, float64
        self.zsnr = zsnr  # rescaled to zero terminal SNR (ModelSamplingDiscrete's zsnr)
        self.sigmas = (rescale_zero_terminal_snr_sigmas(sigmas) if zsnr else sigmas).float()
        self.log_sigmas = self.sigmas.log()
        self.quantize = quantize  # timestep() rounds to the nearest trained timestep, as ComfyUI does

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def sigma_to_t(self, sigma: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        """Timestep whose log-sigma interpolates the table (k-diffusion DiscreteSchedule); on the CPU."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32).cpu()
        log_sigma = sigma.log()
        dists = log_sigma - self.log_sigmas[:, None]  # (T, N)
        if quantize:
            return dists.abs().argmin(dim=0).view(sigma.shape).float()
        low_idx = dists.ge(0).cumsum(dim=0).argmax(dim=0).clamp(max=len(self.log_sigmas) - 2)
        high_idx = low_idx + 1
        low, high = self.log_sigmas[low_idx], self.log_sigmas[high_idx]
        w = ((low - log_sigma.flatten()) / (low - high)).clamp(0, 1)
        return ((1 - w) * low_idx + w * high_idx).view(sigma.shape)

    def t_to_sigma(self, t: torch.Tensor) -> torch.Tensor:
        """Sigma at a (fractional) timestep, interpolating log-sigma linearly; on the CPU."""
        t = torch.as_tensor(t, dtype=torch.float32).cpu().clamp(0, len(self.sigmas) - 1)
        low_idx, high_idx, w = t.floor().long(), t.ceil().long(), t.frac()
        return ((1 - w) * self.log_sigmas[low_idx] + w * self.log_sigmas[high_idx]).exp()

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep the network is conditioned on for this sigma."""
        return self.sigma_to_t(sigma, quantize=self.quantize)

    def percent_to_sigma(self, percent: float) -> float:
        """Sigma at a fraction of the way through sampling, as ComfyUI's ModelSamplingDiscrete: the table's
        sigma at timestep (1 - percent) * 999 (the last timestep); 999999999.9 at 0, 0.0 at 1."""
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        return float(self.t_to_sigma(torch.tensor((1.0 - percent) * (len(self.sigmas) - 1))))


def _expand(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a per-batch (or scalar) sigma to broadcast over x: (B,) -> (B, 1, 1, 1)."""
    sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    return sigma.reshape(sigma.shape[:1] + (1,) * (x.ndim - 1)) if sigma.ndim else sigma


class EpsPrediction(DiscreteSchedule):
    """A network that predicts the noise epsilon (Ho et al. 2020): c_skip = 1, c_out = -sigma."""

    sigma_data = 1.0

    def calculate_input(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x / (_expand(sigma, x) ** 2 + self.sigma_data ** 2).sqrt()

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        return x - model_output * _expand(sigma, x)

    def noise_scaling(self, sigma: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor,
                      max_denoise: bool = False) -> torch.Tensor:
        """Noise the latent to level sigma; at full denoise ComfyUI scales by sqrt(1 + sigma^2)."""
        sigma = _expand(sigma, noise)
        scale = (1.0 + sigma ** 2).sqrt() if max_denoise else sigma
        return latent + noise * scale

    def inverse_noise_scaling(self, sigma: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        return latent


class VPrediction(EpsPrediction):
    """A network that predicts v (Salimans & Ho 2022), with the scalings of Karras et al. (2022)."""

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        sigma = _expand(sigma, x)
        c_skip = self.sigma_data ** 2 / (sigma ** 2 + self.sigma_data ** 2)
        c_out = -sigma * self.sigma_data / (sigma ** 2 + self.sigma_data ** 2).sqrt()
        return c_skip * x + c_out * model_output


class X0Prediction(EpsPrediction):
    """A network that predicts the clean sample itself (ComfyUI's X0): the denoised output is the output."""

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        return model_output


class LCMPrediction(EpsPrediction):
    """Latent Consistency Models (Luo et al. 2023) as ComfyUI's ModelSamplingDiscrete "lcm": the table keeps
    the 50 timesteps of LCM's distillation (19, 39, ..., 999), and the network's eps prediction goes through
    the consistency boundary condition, c_skip x + c_out x0 at timestep scaling 10 and sigma_data 0.5."""

    original_timesteps = 50
    timestep_scaling = 10.0
    boundary_sigma_data = 0.5

    def __init__(self, zsnr: bool = False):
        super().__init__(zsnr=zsnr)
        full = self.sigmas
        self.skip_steps = len(full) // self.original_timesteps
        kept = [len(full) - 1 - i * self.skip_steps for i in range(self.original_timesteps)]
        self.sigmas = full[kept].flip(0)  # (50,) ascending
        self.log_sigmas = self.sigmas.log()

    def sigma_to_t(self, sigma: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        """The distilled timestep: 19, 39, ..., 999 for the table's sigmas (fractional between them)."""
        return super().sigma_to_t(sigma, quantize) * self.skip_steps + (self.skip_steps - 1)

    def t_to_sigma(self, t: torch.Tensor) -> torch.Tensor:
        return super().t_to_sigma((torch.as_tensor(t, dtype=torch.float32) - (self.skip_steps - 1))
                                  / self.skip_steps)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.sigma_to_t(sigma, quantize=True)

    def percent_to_sigma(self, percent: float) -> float:
        """As the full schedule's: the sigma at timestep (1 - percent) * 999 of the undistilled timesteps."""
        if percent <= 0.0 or percent >= 1.0:
            return super().percent_to_sigma(percent)
        last = self.skip_steps * self.original_timesteps - 1  # 999
        return float(self.t_to_sigma(torch.tensor((1.0 - percent) * last)))

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        scaled = _expand(self.timestep(torch.as_tensor(sigma).cpu()).to(x.device), x) * self.timestep_scaling
        x0 = x - model_output * _expand(sigma, x)
        c_skip = self.boundary_sigma_data ** 2 / (scaled ** 2 + self.boundary_sigma_data ** 2)
        c_out = scaled / (scaled ** 2 + self.boundary_sigma_data ** 2) ** 0.5
        return c_out * x0 + c_skip * x


class RectifiedFlow:
    """Rectified-flow parametrisation (ComfyUI's CONST): x = (1 - sigma) x0 + sigma noise, output = velocity.

    Sigmas live in [0, 1]; the data scale at sigma is alpha = 1 - sigma. Subclasses set the table
    `sigmas` (ascending, last 1.0) and the maps `t_to_sigma` / `sigma_to_t` / `timestep`.
    """

    sigmas: torch.Tensor

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.sigmas[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.sigmas[-1]

    def percent_to_sigma(self, percent: float) -> float:
        """Sigma at a fraction of the way through sampling (1.0 at 0, 0.0 at 1), as ComfyUI."""
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return float(self.shift_time(torch.tensor(1.0 - percent, dtype=torch.float64)))

    def shift_time(self, t: torch.Tensor) -> torch.Tensor:
        """The shift warp from flow time t in [0, 1] to sigma."""
        raise NotImplementedError

    def calculate_input(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        return x - model_output * _expand(sigma, x)

    def noise_scaling(self, sigma: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor,
                      max_denoise: bool = False) -> torch.Tensor:
        """Noise the latent to level sigma; at sigma 1 (full denoise) this is the noise itself."""
        sigma = _expand(sigma, noise)
        return sigma * noise + (1.0 - sigma) * latent

    def inverse_noise_scaling(self, sigma: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        return latent / (1.0 - _expand(sigma, latent))


class FlowMatching(RectifiedFlow):
    """SD3-style rectified flow (Esser et al. 2024), ComfyUI's ModelSamplingDiscreteFlow.

    sigma(t) = shift * s / (1 + (shift - 1) * s) with s = t / multiplier; the network sees
    timestep = sigma * multiplier. The table holds sigma at s = 1/timesteps .. 1.
    """

    def __init__(self, shift: float = 1.0, multiplier: float = 1000.0, timesteps: int = 1000):
        if shift <= 0:
            raise ValueError(f"flow shift must be > 0; got {shift}")
        if timesteps < 2:
            raise ValueError(f"flow timesteps must be >= 2; got {timesteps}")
        self.shift, self.multiplier = shift, multiplier
        self.sigmas = self.t_to_sigma(torch.arange(1, timesteps + 1) / timesteps * multiplier)  # (T,)

    def shift_time(self, t: torch.Tensor) -> torch.Tensor:
        return self.shift * t / (1 + (self.shift - 1) * t)

    def t_to_sigma(self, t: torch.Tensor) -> torch.Tensor:
        return self.shift_time(torch.as_tensor(t, dtype=torch.float32) / self.multiplier)

    def sigma_to_t(self, sigma: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        """Inverse of t_to_sigma, in the network's timestep units."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        return sigma / (self.shift - (self.shift - 1) * sigma) * self.multiplier

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(sigma, dtype=torch.float32) * self.multiplier


class FluxFlowMatching(RectifiedFlow):
    """FLUX.1-dev's rectified flow, ComfyUI's ModelSamplingFlux (Black Forest Labs 2024).

    sigma(t) = e^shift / (e^shift + (1 / t - 1)) for t in (0, 1]; the network is fed timestep = sigma
    (FLUX scales it by 1000 itself). The table holds sigma at t = 1/timesteps .. 1; sigma_max is 1.0.
    """

    def __init__(self, shift: float = 1.15, timesteps: int = 10000):
        if timesteps < 2:
            raise ValueError(f"flow timesteps must be >= 2; got {timesteps}")
        self.shift = shift
        self.sigmas = self.t_to_sigma(torch.arange(1, timesteps + 1) / timesteps)  # (T,)

    def shift_time(self, t: torch.Tensor) -> torch.Tensor:
        return math.exp(self.shift) / (math.exp(self.shift) + (1 / t - 1))

    def t_to_sigma(self, t: torch.Tensor) -> torch.Tensor:
        return self.shift_time(torch.as_tensor(t, dtype=torch.float32))

    def sigma_to_t(self, sigma: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        """Inverse of t_to_sigma: t = sigma / (sigma + e^shift (1 - sigma))."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        return sigma / (sigma + math.exp(self.shift) * (1 - sigma))

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(sigma, dtype=torch.float32)


def flux_shift_for(width: int, height: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift (ComfyUI's ModelSamplingFlux node, diffusers' calculate_shift).

    Linear in the image's token count, width * height / (8 * 8 * 2 * 2) for pixel sizes (VAE /8, 2x2
    patches): base_shift at 256 tokens (256 x 256 pixels), max_shift at 4096 tokens (1024 x 1024).
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive pixels; got {width} x {height}")
    slope = (max_shift - base_shift) / (4096 - 256)
    return width * height / (8 * 8 * 2 * 2) * slope + base_shift - slope * 256


ModelSampling = EpsPrediction | VPrediction | X0Prediction | LCMPrediction | FlowMatching | FluxFlowMatching

# ComfyUI's ModelSamplingDiscrete choices: what an SD network predicts on the standard scaled-linear schedule
DISCRETE_PREDICTIONS: dict[str, type[EpsPrediction]] = {"eps": EpsPrediction, "v_prediction": VPrediction,
                                                        "lcm": LCMPrediction, "x0": X0Prediction}


def discrete_model_sampling(prediction: str, zsnr: bool = False) -> EpsPrediction:
    """The model sampling of ModelSamplingDiscrete: `prediction` (eps, v_prediction, lcm, x0) on SD's
    schedule, rescaled to zero terminal SNR when `zsnr`."""
    if prediction not in DISCRETE_PREDICTIONS:
        raise ValueError(f"unknown sampling {prediction!r}; accepted: {', '.join(DISCRETE_PREDICTIONS)}")
    return DISCRETE_PREDICTIONS[prediction](zsnr=zsnr)

UnetFn = Callable[..., torch.Tensor]  # unet_fn(x_in, timesteps, context, y=None[, guidance=]) -> model output


@dataclass
class Denoiser:
    """Wraps `unet_fn(x_in, timesteps, context, y=None)` into a k-diffusion denoiser `(x, sigma) -> x0`.

    `guidance` (B,), the strength a guidance-distilled model (FLUX) is conditioned on, reaches `unet_fn` as
    `guidance=` only when given, so networks without that input need not accept it; so do further keyword
    inputs (a ControlNet's `control=`). `concat` (B, C', H, W), the extra input channels of inpainting UNets
    (ComfyUI's c_concat), follows the scaled input x. The guided denoisers (guidance.py) read `cfg_function`,
    the model's replacement of the CFG mix, and `resolve`, which turns the model's CONDITIONING into sampler
    entries for a (width, height) pixel image (for cfg functions that predict further prompts).
    """

    unet_fn: UnetFn
    model_sampling: ModelSampling
    cfg_function: Callable[..., torch.Tensor] | None = None  # CfgInputs -> guided x0 (RescaleCFG, PerpNeg)
    resolve: Callable[[list, int, int], list] | None = None  # (CONDITIONING, width, height) -> entries

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor | None = None,
                 y: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
                 concat: torch.Tensor | None = None, **extra: object) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])  # (B,)
        x_in = self.model_sampling.calculate_input(sigma, x)
        if concat is not None:
            x_in = torch.cat([x_in, concat.to(x_in)], dim=1)  # (B, C + C', H, W)
        timesteps = self.model_sampling.timestep(sigma.cpu()).to(x.device)
        options = {key: value for key, value in extra.items() if value is not None}
        if guidance is not None:
            options["guidance"] = guidance
        model_output = self.unet_fn(x_in, timesteps, context, y=y, **options)
        return self.model_sampling.calculate_denoised(sigma, model_output.to(x.dtype), x)


def max_denoise(model_sampling: ModelSampling, sigmas: torch.Tensor) -> bool:
    """True when sampling starts at (or above) the model's largest sigma, i.e. from pure noise."""
    sigma, sigma_max = float(sigmas[0]), float(model_sampling.sigma_max)
    return math.isclose(sigma_max, sigma, rel_tol=1e-05) or sigma > sigma_max
