"""ComfyUI's KSampler choices, written down from its comfy/samplers.py on the master branch: SAMPLER_NAMES
= KSAMPLER_NAMES + ["ddim", "uni_pc", "uni_pc_bh2"] and SCHEDULER_NAMES = list(SCHEDULER_HANDLERS)."""

COMFY_SAMPLER_NAMES = [
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "exp_heun_2_x0",
    "exp_heun_2_x0_sde", "dpm_2", "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral",
    "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde",
    "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu",
    "ddpm", "lcm", "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp",
    "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp", "gradient_estimation",
    "gradient_estimation_cfg_pp", "er_sde", "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece", "ddim",
    "uni_pc", "uni_pc_bh2",
]
COMFY_SCHEDULER_NAMES = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
                         "linear_quadratic", "kl_optimal"]
