"""Schedulers: functions from (model sampling, steps) to a descending sigma sequence ending in 0.

Definitions follow ComfyUI's comfy/samplers.py and k-diffusion's sampling.py for the names they share,
stable-diffusion.cpp's denoiser.hpp for `smoothstep` and `lcm`. Every function returns a float32 tensor
of `steps + 1` sigmas (fewer only where the definition itself merges duplicate timesteps: `beta`).

On rectified-flow models (FLUX, SD3: sigmas in [0, 1]) each scheduler ComfyUI has returns what
ComfyUI's does for the same model sampling; `smoothstep` and `lcm` pick table entries by index. Worth
knowing: `normal` / `sgm_uniform` space the network's timesteps, which for FLUX (timestep = sigma) means
the shift warps an already shifted range (ComfyUI's behaviour, not diffusers' FluxPipeline), while
`simple` picks table entries at t = 1 - i / steps, exactly FluxPipeline's schedule when `steps` divides
the table length. `ays`, `ays_sdxl` and `gits` hold published SD1/SDXL noise levels (up to 14.6) and
refuse flow models.
"""

import math
from collections.abc import Callable, Sequence

import torch

from .model_sampling import ModelSampling, RectifiedFlow
from .schedule_tables import GITS_NOISE_LEVELS_1_20

Scheduler = Callable[..., torch.Tensor]  # fn(model_sampling, steps, **options) -> sigmas (steps + 1,)


def _append_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.float(), sigmas.new_zeros([1]).float()])


def _table_sigmas(model_sampling: ModelSampling, indices: torch.Tensor) -> torch.Tensor:
    """The model's table sigmas at integer indices (0 = lowest noise), for any kind of model."""
    return model_sampling.sigmas[indices.long()].float()


def _refuse_flow(name: str, model_sampling: ModelSampling) -> None:
    if isinstance(model_sampling, RectifiedFlow):
        raise ValueError(f"scheduler '{name}' holds published SD1/SDXL noise levels (sigma up to 14.6), "
                         f"not levels for a rectified-flow model (sigmas in [0, 1]); use simple, normal, "
                         f"beta, sgm_uniform or another scheduler")


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> torch.Tensor:
    """Noise schedule of Karras et al. (2022), eq. 5: uniform in sigma^(1/rho)."""
    ramp = torch.linspace(0, 1, steps)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return _append_zero((max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho)


def exponential_sigmas(steps: int, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """Sigmas uniform in log sigma (k-diffusion get_sigmas_exponential)."""
    return _append_zero(torch.linspace(math.log(sigma_max), math.log(sigma_min), steps).exp())


def karras(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """Karras et al. (2022) schedule between the model's sigma_min and sigma_max, rho = 7."""
    return karras_sigmas(steps, float(model_sampling.sigma_min), float(model_sampling.sigma_max))


def exponential(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """Log-uniform sigmas between the model's sigma_min and sigma_max."""
    return exponential_sigmas(steps, float(model_sampling.sigma_min), float(model_sampling.sigma_max))


def normal(model_sampling: ModelSampling, steps: int, sgm: bool = False) -> torch.Tensor:
    """Timesteps uniform from t(sigma_max) to t(sigma_min) (ComfyUI normal_scheduler, sd.cpp discrete)."""
    start = float(model_sampling.timestep(model_sampling.sigma_max))
    end = float(model_sampling.timestep(model_sampling.sigma_min))
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    elif math.isclose(float(model_sampling.t_to_sigma(end)), 0, abs_tol=1e-5):
        return model_sampling.t_to_sigma(torch.linspace(start, end, steps + 1)).float()
    else:
        timesteps = torch.linspace(start, end, steps)
    return _append_zero(model_sampling.t_to_sigma(timesteps))


def sgm_uniform(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """SGM's uniform timestep spacing: `steps` of `steps + 1` uniform timesteps, then 0."""
    return normal(model_sampling, steps, sgm=True)


def simple(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """Every (len(table) / steps)-th sigma of the model's table from the top (ComfyUI simple_scheduler)."""
    table = model_sampling.sigmas
    stride = len(table) / steps
    return _append_zero(torch.stack([table[-(1 + int(i * stride))] for i in range(steps)]))


def ddim_uniform(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """DDIM's uniform timestep spacing from the table (ComfyUI ddim_scheduler)."""
    table = model_sampling.sigmas
    ends_at_zero = math.isclose(float(table[1]), 0, abs_tol=1e-5)  # then the table's own ~0 ends it
    stride = max(len(table) // (steps + 1 if ends_at_zero else steps), 1)
    picked = [float(table[x]) for x in range(1, len(table), stride)]
    return torch.tensor((picked if ends_at_zero else [0.0] + picked)[::-1], dtype=torch.float32)


def _regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by the continued fraction of Numerical Recipes (betacf), modified Lentz method."""
    if x <= 0.0 or x >= 1.0:
        return min(max(x, 0.0), 1.0)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _regularized_incomplete_beta(1.0 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def beta_ppf(p: float, a: float, b: float) -> float:
    """Inverse CDF of the Beta(a, b) distribution, by bisection on the regularized incomplete beta."""
    low, high = 0.0, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _regularized_incomplete_beta(mid, a, b) < p else (low, mid)
    return (low + high) / 2


def beta(model_sampling: ModelSampling, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    """Timesteps at Beta(alpha, beta) quantiles (Lee et al. 2024, "Beta Sampling is All You Need")."""
    total_timesteps = len(model_sampling.sigmas) - 1
    sigmas, last_t = [], None
    for i in range(steps):
        t = round(beta_ppf(1.0 - i / steps, alpha, beta) * total_timesteps)
        if t != last_t:
            sigmas.append(float(model_sampling.sigmas[t]))
        last_t = t
    return torch.tensor(sigmas + [0.0], dtype=torch.float32)


def kl_optimal(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """KL-optimal schedule (Sabour et al. 2024, "Align Your Steps"): uniform in arctan(sigma)."""
    sigma_min, sigma_max = float(model_sampling.sigma_min), float(model_sampling.sigma_max)
    ramp = torch.arange(steps, dtype=torch.float32) / max(steps - 1, 1)
    return _append_zero((ramp * math.atan(sigma_min) + (1 - ramp) * math.atan(sigma_max)).tan())


def linear_quadratic(model_sampling: ModelSampling, steps: int, threshold_noise: float = 0.025,
                     linear_steps: int | None = None) -> torch.Tensor:
    """Linear then quadratic schedule of Mochi (Genmo 2024), as ComfyUI's linear_quadratic_schedule."""
    if steps == 1:
        schedule = [1.0, 0.0]
    else:
        linear_steps = steps // 2 if linear_steps is None else linear_steps
        linear = [i * threshold_noise / linear_steps for i in range(linear_steps)]
        step_diff = linear_steps - threshold_noise * steps
        quadratic_steps = steps - linear_steps
        quadratic_coef = step_diff / (linear_steps * quadratic_steps ** 2)
        linear_coef = threshold_noise / linear_steps - 2 * step_diff / (quadratic_steps ** 2)
        const = quadratic_coef * linear_steps ** 2
        quadratic = [quadratic_coef * i ** 2 + linear_coef * i + const for i in range(linear_steps, steps)]
        schedule = [1.0 - s for s in linear + quadratic + [1.0]]
    return torch.tensor(schedule, dtype=torch.float32) * float(model_sampling.sigma_max)


def smoothstep(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """Timesteps at smoothstep(1 - i/n) * t_max (stable-diffusion.cpp SmoothStepScheduler)."""
    t_max = len(model_sampling.sigmas) - 1
    u = 1.0 - torch.arange(steps, dtype=torch.float64) / steps
    timesteps = torch.round(u * u * (3.0 - 2.0 * u) * t_max)
    return _append_zero(_table_sigmas(model_sampling, timesteps))


def lcm(model_sampling: ModelSampling, steps: int, original_steps: int = 50) -> torch.Tensor:
    """LCM's skipping-step timesteps (Luo et al. 2023) on a 50-step grid, as stable-diffusion.cpp."""
    stride = len(model_sampling.sigmas) // original_steps
    timesteps = [(original_steps - (i * original_steps) // steps) * stride - 1 for i in range(steps)]
    return _append_zero(_table_sigmas(model_sampling, torch.tensor(timesteps)))


def loglinear_interp(sigmas: Sequence[float], num: int) -> torch.Tensor:
    """Resample a descending sigma list to `num` points, linearly in log sigma (Align Your Steps)."""
    ys = torch.tensor(sigmas, dtype=torch.float64).flip(0).log()
    xs = torch.linspace(0, 1, len(sigmas), dtype=torch.float64)
    new_xs = torch.linspace(0, 1, num, dtype=torch.float64)
    idx = torch.searchsorted(xs, new_xs, right=True).clamp(1, len(xs) - 1)
    w = (new_xs - xs[idx - 1]) / (xs[idx] - xs[idx - 1])
    return (ys[idx - 1] + w * (ys[idx] - ys[idx - 1])).exp().flip(0)


# Align Your Steps (Sabour et al. 2024) 10-step noise levels, from NVIDIA's how-to page as ComfyUI uses them.
AYS_NOISE_LEVELS = {
    "sd1": [14.6146412293, 6.4745760956, 3.8636745985, 2.6946151520, 1.8841921177, 1.3943805092,
            0.9642583904, 0.6523686016, 0.3977456272, 0.1515232662, 0.0291671582],
    "sdxl": [14.6146412293, 6.3184485287, 3.7681790315, 2.1811480769, 1.3405244945, 0.8620721141,
             0.5550693289, 0.3798540708, 0.2332364134, 0.1114188177, 0.0291671582],
}


def ays(model_sampling: ModelSampling, steps: int, family: str = "sd1") -> torch.Tensor:
    """Align Your Steps (Sabour et al. 2024): the published levels, log-linearly resampled to `steps`."""
    _refuse_flow("ays", model_sampling)
    if family not in AYS_NOISE_LEVELS:
        raise ValueError(f"no Align Your Steps levels for model family '{family}'; accepted: "
                         f"{', '.join(AYS_NOISE_LEVELS)}")
    levels = AYS_NOISE_LEVELS[family]
    sigmas = torch.tensor(levels) if steps + 1 == len(levels) else loglinear_interp(levels, steps + 1)
    sigmas = sigmas.float().clone()
    sigmas[-1] = 0.0
    return sigmas


def ays_sdxl(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """Align Your Steps with the SDXL levels."""
    return ays(model_sampling, steps, family="sdxl")


def gits(model_sampling: ModelSampling, steps: int) -> torch.Tensor:
    """GITS (Chen et al. 2024) searched SD1.5 sigmas for coeff 1.20, log-linear beyond 20 steps."""
    _refuse_flow("gits", model_sampling)
    if steps < 2:
        raise ValueError(f"the gits scheduler needs at least 2 steps; got {steps}")
    if steps <= 20:
        sigmas = torch.tensor(GITS_NOISE_LEVELS_1_20[steps - 2], dtype=torch.float32)
    else:
        sigmas = loglinear_interp(GITS_NOISE_LEVELS_1_20[-1], steps + 1).float()
    sigmas[-1] = 0.0
    return sigmas


def custom(sigmas: Sequence[float]) -> torch.Tensor:
    """User-given sigmas, validated: non-negative, descending; a trailing 0 is appended if missing."""
    values = [float(s) for s in sigmas]
    if not values:
        raise ValueError("custom sigmas are empty; give a descending list such as 14.6, 7.0, 2.1, 0.5, 0")
    if any(not math.isfinite(s) or s < 0 for s in values):
        raise ValueError(f"custom sigmas must be finite and >= 0; got {values}")
    if any(b >= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"custom sigmas must be strictly descending; got {values}")
    if values[-1] != 0.0:
        values.append(0.0)
    return torch.tensor(values, dtype=torch.float32)


SCHEDULERS: dict[str, Scheduler] = {
    "normal": normal,
    "discrete": normal,
    "karras": karras,
    "exponential": exponential,
    "ays": ays,
    "ays_sdxl": ays_sdxl,
    "gits": gits,
    "sgm_uniform": sgm_uniform,
    "simple": simple,
    "smoothstep": smoothstep,
    "kl_optimal": kl_optimal,
    "lcm": lcm,
    "beta": beta,
    "ddim_uniform": ddim_uniform,
    "linear_quadratic": linear_quadratic,
}


def resolve_scheduler(name: str) -> Scheduler:
    """The scheduler registered under `name` (case-insensitive)."""
    key = name.strip().lower()
    if key not in SCHEDULERS:
        raise ValueError(f"unknown scheduler '{name}'; accepted: {', '.join(SCHEDULERS)}, custom")
    return SCHEDULERS[key]


def calculate_sigmas(scheduler: str, model_sampling: ModelSampling, steps: int, family: str | None = None,
                     custom_sigmas: Sequence[float] | None = None) -> torch.Tensor:
    """Sigmas for `steps` steps; `family` picks the Align Your Steps table, `custom` takes `custom_sigmas`."""
    if scheduler.strip().lower() == "custom":
        if custom_sigmas is None:
            raise ValueError("scheduler 'custom' needs custom_sigmas (a descending list ending in 0)")
        return custom(custom_sigmas)
    fn = resolve_scheduler(scheduler)
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if fn is ays and family is not None:
        return ays(model_sampling, steps, family=family.lower())
    return fn(model_sampling, steps)
