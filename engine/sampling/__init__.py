"""Sampling: k-diffusion-style samplers and schedulers, classifier-free guidance, the KSampler job.

model_sampling (sigma tables, eps/v/flow parametrisations, Denoiser), schedulers (+ schedule_tables),
samplers / samplers_multistep / samplers_sde / samplers_dpm_solver / samplers_unipc / samplers_sa_solver (one
function per sampler), registry (names -> functions), flow (how samplers serve rectified-flow models),
guidance (CFGDenoiser), inpaint (noise masks, inpainting UNets' extra channels), noise (seeded noise),
preview (latent -> RGB), sample (the job).
"""
