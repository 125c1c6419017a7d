"""Whole SD1.5 and SDXL generations through Sluice's node graph, cold (a new process) and warm, resident and
under `--max-vram` budgets, beside diffusers: the acceptance program of issue 21.

    python3 bench/e2e.py                 # on a GPU: SD1.5 512x512 and SDXL 1024x1024, random fp16 weights
    python3 bench/e2e.py --tiny          # a CPU smoke run: tiny checkpoints, float32, 64x64, 2 steps

A generation is the default workflow's shape, CheckpointLoaderSimple -> CLIPTextEncode (positive, negative)
-> EmptyLatentImage -> KSampler (euler, normal, cfg 7, 20 steps) -> VAEDecode -> SaveImage, run by
engine.graph.executor.Executor with settings whose models folder holds the checkpoints this program writes
once into --workdir (tests/engine/models/sd_checkpoints.py's layouts: every key and shape of a real
single-file SD1.5 / SDXL checkpoint; random fp16 values with standard deviation 1/sqrt(fan in), so that
activations stay finite in fp16). A budget mode is the workflow's settings.memory {"max_vram": "B"},
applied as `sluice run` applies it (app.cli.configure_memory).

Every mode runs in a new process (`bench/e2e.py --child ...`):
- cold: its first generation; "s/image" is from loading the checkpoint (out of the page cache) to the saved
  PNG, "process s" from spawning the process to the saved PNG, "import s" the imports before it (torch,
  app.cli, the executor, the node registry built), "after torch s" the part of them after `import torch`
  (Sluice's engine and nodes, and the registry built);
- warm: --warm-runs more generations in that process, each with a new seed and positive prompt (the
  executor's cache keeps the loaded checkpoint and the negative prompt's conditioning, as in the app); the
  median by s/image is reported.
s/step is the KSampler node's seconds / steps; "cb ms" the median interval between the sampler's per-step
callbacks. Peaks are torch.cuda.max_memory_allocated / max_memory_reserved: for cold, since the process
began; for warm, reset before each generation. "fits" is peak allocated <= budget and reserved <= 1.1 x
budget. The profile cache (SLUICE_CACHE) is a new folder per program run: each model's first process (mode
"resident, empty profile cache", one cold generation) measures its probes and stage profiles, later ones
read them (the "cache" column: files in it at start), as every run after a user's first does.

diffusers (test-only, skipped with a note when absent): StableDiffusion(XL)Pipeline.from_single_file on the
same checkpoint with a local config folder this program writes (offline), fp16, EulerDiscreteScheduler,
resident and with enable_model_cpu_offload (CUDA only); cold and warm as above. SDXL's VAE config keeps
diffusers' default force_upcast (decode in fp32), as the published SDXL VAE config does.

The UNet-only step for the same model (bench/memory.py's resident row: the UNet alone through the runtime,
batch 2, CUDA graphs as configured) is measured in the resident process after its warm runs, so that "warm
end-to-end step <= 1.1 x UNet-only step" can be read off. Writes e2e_[tiny_]<device>_<time>.log and .json
under --out.
"""

from __future__ import annotations

import time

SPAWNED_AT = time.time()  # this process's first statement: the child's import clock starts here

import argparse  # noqa: E402
import compileall  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TextIO  # noqa: E402

from plots import Bars, Panel, draw  # noqa: E402  (bench/plots.py, beside this file)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GIB = 1024**3
MODELS = {"sd15": ("sd1", 512), "sdxl": ("sdxl", 1024)}  # name -> (sd_checkpoints family, side in pixels)
TINY_SIDE, TINY_STEPS = 64, 2
CFG, SAMPLER, SCHEDULER, NEGATIVE = 7.0, "euler", "normal", "blurry, low quality"
PROMPTS = ("a lighthouse on a cliff at dusk, waves on black rocks, cinematic photograph",
           "a red fox in fresh snow under pine trees, morning light, telephoto",
           "an old library with tall shelves and a rolling ladder, warm lamps, wide angle",
           "a bowl of ramen on a wooden table, steam rising, food photography")
EMPTY_CACHE = "resident, empty profile cache"  # the mode of each model's first process
TINY_BUDGET_SCALE = 1 / 32  # --tiny: a budget of B "GiB" is B/32 GiB of the CPU (the models are a few MiB)


@dataclass
class Row:
    system: str  # sluice or diffusers
    model: str  # sd15 or sdxl
    mode: str  # resident, max-vram 2 GiB, model cpu offload
    run: str  # cold or warm (median of the warm runs)
    image_s: float | None = None  # checkpoint load (cold) or prompt (warm) to the saved PNG
    step_s: float | None = None  # sampling seconds / steps
    callback_ms: float | None = None  # median interval between per-step callbacks
    text_s: float | None = None
    sampling_s: float | None = None
    decode_s: float | None = None  # VAE decode (Sluice) or decode and postprocess (diffusers)
    load_s: float | None = None  # cold: the loader node; diffusers' from_single_file and placing
    process_s: float | None = None  # cold: process spawned to the saved PNG
    import_s: float | None = None  # cold: the imports before the generation
    after_torch_s: float | None = None  # cold: the part of import_s after `import torch` (Sluice's own)
    peak_allocated_gib: float | None = None  # None off CUDA
    peak_reserved_gib: float | None = None
    budget_gib: float | None = None  # the --max-vram budget; None: none
    cache_files: int | None = None  # cold Sluice: files in the profile cache when the process began
    error: str | None = None  # the mode failed: why
    pools: dict[str, float] | None = None  # CUDA: reserved/allocated GiB after the run, graph pools apart

    @property
    def fits(self) -> str:
        if self.budget_gib is None or self.peak_allocated_gib is None:
            return "-"
        allocated = self.peak_allocated_gib <= self.budget_gib
        reserved = self.peak_reserved_gib <= 1.1 * self.budget_gib
        return f"{'yes' if allocated else 'NO'} / {'yes' if reserved else 'NO'}"


# -------------------------------------------------------------------------------------------- the parent


LOG: list[TextIO] = []


def say(text: str) -> None:
    print(text, flush=True)
    for log in LOG:
        log.write(text + "\n")
        log.flush()


def tests_helpers() -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "engine" / "models"))
    import sd_checkpoints

    return sd_checkpoints


def write_checkpoint(path: Path, family: str, size: str, dtype: Any, device: str) -> None:
    """A single-file checkpoint of `family` with the real layout and random weights of std 1/sqrt(fan in)
    (norm scales 1, biases 0), drawn on `device`; kept when it already exists (written by an earlier run)."""
    import torch

    helpers = tests_helpers()
    if path.exists():
        say(f"  {path} exists: reused")
        return
    began = time.perf_counter()
    generator = torch.Generator(device).manual_seed(0)
    state = {}
    for key, shape in helpers.checkpoint_shapes(family, size).items():
        if len(shape) >= 2:
            drawn = torch.randn(shape, generator=generator, device=device) / math.prod(shape[1:]) ** 0.5
            state[key] = drawn.to(dtype).cpu()
        else:  # a 1-D weight is a norm's scale
            state[key] = torch.full(shape, 1.0 if key.endswith("weight") else 0.0, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    helpers.save_state_dict(partial, state, "safetensors")
    os.replace(partial, path)
    say(f"  wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {time.perf_counter() - began:.1f} s")


def write_diffusers_config(folder: Path, family: str, size: str) -> None:
    """model_index.json and every component's config (no weights) of the pipeline diffusers' from_single_file
    builds from our checkpoint, so that it runs offline."""
    if (folder / "model_index.json").exists():
        return
    import torch

    pipe = diffusers_pipeline_from_configs(family, size, torch.device("meta"))
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_config(folder)
    for name, component in pipe.components.items():
        if component is None:
            continue
        target = folder / name
        if hasattr(component, "save_pretrained") and "Tokenizer" in type(component).__name__:
            component.save_pretrained(target)
        elif hasattr(component, "save_config"):
            component.save_config(target)
        else:  # a transformers model: its config alone
            component.config.save_pretrained(target)


def diffusers_pipeline_from_configs(family: str, size: str, device: Any) -> Any:
    """StableDiffusion(XL)Pipeline with the checkpoint's configs (sd_checkpoints' specs), its models built on
    `device` (meta: configs only)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from engine.models.tokenizer import build_vocab, load_merges

    spec = tests_helpers().family_spec(family, size)
    u, v = spec.unet, spec.vae
    unet_config: dict[str, Any] = dict(
        sample_size=MODELS["sdxl" if family == "sdxl" else "sd15"][1] // 8, in_channels=4, out_channels=4,
        down_block_types=tuple("CrossAttnDownBlock2D" if d else "DownBlock2D" for d in u.transformer_depth),
        up_block_types=tuple("CrossAttnUpBlock2D" if d else "UpBlock2D"
                             for d in reversed(u.transformer_depth)),
        block_out_channels=tuple(u.model_channels * m for m in u.channel_mult),
        layers_per_block=u.num_res_blocks, cross_attention_dim=u.context_dim,
        transformer_layers_per_block=tuple(max(d, 1) for d in u.transformer_depth),
        use_linear_projection=u.use_linear)
    if family == "sdxl":  # heads of 64 channels; the ADM vector: pooled CLIP-G + 6 Fourier embeddings
        heads = tuple(max(1, u.model_channels * m // 64) for m in u.channel_mult)
        unet_config.update(attention_head_dim=heads, addition_embed_type="text_time",
                           addition_time_embed_dim=256,
                           projection_class_embeddings_input_dim=u.adm_in_channels)
    else:
        unet_config["attention_head_dim"] = 8  # SD1.5's 8 heads (diffusers' historical name)
    with torch.device(device):
        unet = UNet2DConditionModel(**unet_config)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(v.ch_mult),
            up_block_types=("UpDecoderBlock2D",) * len(v.ch_mult),
            block_out_channels=tuple(v.ch * m for m in v.ch_mult), layers_per_block=v.num_res_blocks,
            latent_channels=4, norm_num_groups=32, sample_size=1024,
            scaling_factor=0.13025 if family == "sdxl" else 0.18215, force_upcast=family == "sdxl")
    merges = load_merges()
    tokenizer = CLIPTokenizer(vocab={token: i for i, token in enumerate(build_vocab(merges))},
                              merges=list(merges), model_max_length=77)
    encoders = []
    for text in spec.text:
        config = CLIPTextConfig(
            vocab_size=text.vocab_size, hidden_size=text.width, intermediate_size=text.intermediate,
            num_hidden_layers=text.layers, num_attention_heads=max(1, text.width // 64),
            max_position_embeddings=text.max_positions,
            hidden_act="quick_gelu" if text.layout == "hf" else "gelu",
            projection_dim=text.projection_dim or text.width, bos_token_id=49406, eos_token_id=49407)
        with torch.device(device):
            encoders.append((CLIPTextModelWithProjection if text.projection_dim else CLIPTextModel)(config))
    scheduler = EulerDiscreteScheduler(  # SD1.5's and SDXL's scheduler_config: scaled linear betas
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, timestep_spacing="leading")
    if family == "sdxl":
        return StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                         tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
                                         scheduler=scheduler)
    return StableDiffusionPipeline(vae=vae, text_encoder=encoders[0], tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def spawn(args: argparse.Namespace, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run one child process on `spec`; its JSON result (or {"error": ...})."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    began = time.time()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=args.child_timeout)
    if spec.get("log_level"):
        name = f"stderr_{spec['model']}_{spec['mode'].replace(' ', '_').replace(',', '')}.txt"
        (Path(spec["out"]) / name).write_text(result.stderr)
    for line in result.stderr.splitlines():
        if line.startswith("e2e:"):
            say("    " + line[4:].strip())
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = "\n".join(result.stderr.strip().splitlines()[-12:])
        return {"error": f"the child exited {result.returncode} without a result:\n{tail}"}
    data["spawned_at"] = began
    if data.get("error"):
        say("\n".join("    | " + line for line in result.stderr.strip().splitlines()[-15:]))
    return data


def rows_of(data: dict[str, Any], system: str, model: str, mode: str, budget: float | None,
            cold: bool) -> list[Row]:
    if "error" in data and "runs" not in data:
        return [Row(system, model, mode, "-", budget_gib=budget, error=data["error"].splitlines()[0][:200])]
    rows = []
    runs = data["runs"]
    if cold and runs:
        first = runs[0]
        rows.append(Row(system, model, mode, "cold", **first, budget_gib=budget, import_s=data["import_s"],
                        after_torch_s=data.get("after_torch_s"),
                        process_s=data["saved_at"][0] - data["spawned_at"],
                        cache_files=data.get("cache_files")))
    warm = runs[1:]
    if warm:
        median = sorted(warm, key=lambda r: r["image_s"])[len(warm) // 2]
        rows.append(Row(system, model, mode, "warm", **median, budget_gib=budget))
    if data.get("error"):
        rows.append(Row(system, model, mode, "-", budget_gib=budget,
                        error=data["error"].splitlines()[0][:200]))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| system | model | mode | run | s/image | s/step | cb ms | text s | sampling s | decode s "
             "| load s | process s | import s | after torch s | peak alloc GiB | peak reserved GiB "
             "| fits alloc / reserved | cache |",
             "| --- | --- | --- | --- |" + " ---: |" * 12 + " --- | ---: |"]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.system} | {r.model} | {r.mode} | failed | {r.error} |")
            continue
        cells = [r.image_s, r.step_s, r.callback_ms, r.text_s, r.sampling_s, r.decode_s, r.load_s,
                 r.process_s, r.import_s, r.after_torch_s, r.peak_allocated_gib, r.peak_reserved_gib]
        text = " | ".join("-" if v is None else f"{v:.3f}" for v in cells)
        cache = "-" if r.cache_files is None else str(r.cache_files)
        lines.append(f"| {r.system} | {r.model} | {r.mode} | {r.run} | {text} | {r.fits} | {cache} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> Path:
    """Per model: s/image cold and warm per mode, and the peak allocated and reserved memory (of the warm
    runs; cold where a mode has none) against each mode's budget (CUDA only)."""
    panels = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        modes = list(dict.fromkeys(f"{r.system} {r.mode}" for r in mine))

        def value(field: str, mode: str, runs: tuple[str, ...], mine: list[Row] = mine) -> float | None:
            found = [getattr(r, field) for run in runs for r in mine
                     if f"{r.system} {r.mode}" == mode and r.run == run and getattr(r, field) is not None]
            return found[0] if found else None

        failed = [m for m in modes if all(r.error is not None for r in mine if f"{r.system} {r.mode}" == m)]
        note = f"failed: {', '.join(failed)}" if failed else ""
        seconds = [Bars(run, [value("image_s", m, (run,)) for m in modes]) for run in ("cold", "warm")]
        times = Panel(f"{model}: seconds per image", "s / image", categories=modes, note=note, bars=seconds)
        panels.append(times)
        if not any(r.peak_allocated_gib is not None for r in mine):
            times.note = "; ".join(filter(None, [note, "peak memory: measured on CUDA only"]))
            continue
        budgets = [next((r.budget_gib for r in mine if f"{r.system} {r.mode}" == m), None) for m in modes]
        panels.append(Panel(f"{model}: peak memory (warm runs)", "GiB", categories=modes, limits=budgets,
                            limit_label="budget (--max-vram)", bars=[
                                Bars(label, [value(field, m, ("warm", "cold")) for m in modes])
                                for label, field in (("peak allocated", "peak_allocated_gib"),
                                                     ("peak reserved", "peak_reserved_gib"))]))
    return draw(path, panels, title)


def parent(args: argparse.Namespace) -> int:
    import torch

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    size, dtype = ("tiny", torch.float32) if args.tiny else ("full", torch.float16)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; accepted: {', '.join(MODELS)}")
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    workdir = Path(args.workdir) / ("tiny" if args.tiny else "full")
    stamp = time.strftime("%Y%m%d_%H%M%S")
    stem = f"e2e_{'tiny_' if args.tiny else ''}{device}_{stamp}"
    args.out.mkdir(parents=True, exist_ok=True)
    have_diffusers = not args.no_diffusers and importlib.util.find_spec("diffusers") is not None
    env = {**os.environ, "SLUICE_CACHE": str(workdir / f"profile_cache_{stamp}"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    rows: list[Row] = []
    unet_only: dict[str, float] = {}
    began = time.perf_counter()
    # an installed Sluice has its bytecode (pip compiles it, or its first run writes it): a fresh checkout
    # has none, and every child would then compile the modules a job imports late within its first image
    for package in ("engine", "nodes", "app"):
        compileall.compile_dir(ROOT / package, quiet=1)
    with open(args.out / f"{stem}.log", "w") as log:
        LOG.append(log)
        steps = TINY_STEPS if args.tiny else args.steps
        say(f"e2e on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), torch "
            f"{torch.__version__}: models {', '.join(models)}, {steps} steps {SAMPLER}/{SCHEDULER}, "
            f"cfg {CFG}, budgets {budgets} GiB{' (tiny: x 1/32, of the CPU)' if args.tiny else ''}, "
            f"{args.warm_runs} warm runs, workdir {workdir}")
        say("writing checkpoints ...")
        for model in models:
            family, _ = MODELS[model]
            write_checkpoint(workdir / "models" / "checkpoints" / f"{model}.safetensors", family, size, dtype,
                             device)
            if have_diffusers:
                write_diffusers_config(workdir / "diffusers" / model, family, size)
        if not have_diffusers:
            say("diffusers: " + ("left out (--no-diffusers)" if args.no_diffusers else
                                 "not importable: its rows are left out"))
        for model in models:
            family, side = MODELS[model]
            side = TINY_SIDE if args.tiny else side
            base = {"model": model, "family": family, "side": side, "steps": steps, "workdir": str(workdir),
                    "warm_runs": args.warm_runs, "tiny": args.tiny, "device": device,
                    "profile": args.profile, "memory_history": args.memory_history, "out": str(args.out),
                    "log_level": args.log_level}
            modes: list[tuple[str, str, float | None]] = [("sluice", "resident", None)]
            if not args.no_cold:  # a first process fills the profile cache; the rows after read it
                modes.insert(0, ("sluice", EMPTY_CACHE, None))
            modes += [("sluice", f"max-vram {b:g} GiB", b) for b in budgets]
            if have_diffusers:
                modes.append(("diffusers", "resident", None))
                if device == "cuda":
                    modes.append(("diffusers", "model cpu offload", None))
                else:
                    say("diffusers model cpu offload: needs CUDA; left out")
            for system, mode, budget in modes:
                say(f"{model}: {system} {mode} ({time.perf_counter() - began:.0f} s in) ...")
                spec = {**base, "system": system, "mode": mode, "budget": budget,
                        "unet_only": system == "sluice" and mode == "resident"}
                if mode == EMPTY_CACHE:
                    spec["warm_runs"] = 0
                data = spawn(args, spec, env)
                new = rows_of(data, system, model, mode, budget, not args.no_cold)
                for row in new:
                    say(format_table([row]).splitlines()[-1])
                rows += new
                if "unet_step_s" in data:
                    unet_only[model] = data["unet_step_s"]
                    say(f"  UNet-only step (bench/memory.py's sluice resident row): "
                        f"{data['unet_step_s'] * 1e3:.2f} ms")
        say("\n" + format_table(rows))
        for model, seconds in unet_only.items():
            warm = [r for r in rows if r.model == model and r.system == "sluice" and r.mode == "resident"
                    and r.run == "warm" and r.step_s]
            ratio = f", warm end-to-end step / UNet-only = {warm[0].step_s / seconds:.2f}x" if warm else ""
            say(f"{model}: UNet-only step {seconds * 1e3:.2f} ms{ratio}")
        say(f"total {time.perf_counter() - began:.0f} s")
        LOG.clear()
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "tiny": args.tiny, "steps": steps, "cfg": CFG,
         "sampler": SAMPLER, "scheduler": SCHEDULER, "budgets_gib": budgets, "warm_runs": args.warm_runs,
         "unet_only_step_s": unet_only, "rows": [asdict(r) | {"fits": r.fits} for r in rows]}, indent=2))
    print(f"wrote {args.out / stem}.log and .json", flush=True)
    print(f"wrote {plot(rows, args.out / f'{stem}.png', f'whole generations on {device}, {steps} steps')}")
    return 0 if all(r.error is None for r in rows) else 1


# --------------------------------------------------------------------------------------------- the child


def note(text: str) -> None:
    """A progress line the parent relays."""
    print(f"e2e: {text}", file=sys.stderr, flush=True)


class Clock:
    """Device-synchronized times of the executor's node events and the sampler's per-step callbacks."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.started: dict[str, float] = {}  # node type -> time (the last node of that type)
        self.seconds: dict[str, float] = {}  # node type -> seconds summed over its nodes
        self.callbacks: list[float] = []
        self.types: dict[str, str] = {}
        self.saved_at: float | None = None  # wall clock (time.time) of the saved PNG

    def now(self) -> float:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def __call__(self, event: Any) -> None:
        if event.kind == "node_started":
            self.types[event["node_id"]] = event["node_type"]
            self.started[event["node_id"]] = self.now()
        elif event.kind == "node_finished":
            node_type = self.types[event["node_id"]]
            seconds = self.now() - self.started[event["node_id"]]
            self.seconds[node_type] = self.seconds.get(node_type, 0.0) + seconds
            if node_type == "SaveImage":
                self.saved_at = time.time()
        elif event.kind == "progress":
            self.callbacks.append(time.perf_counter())


def peaks(device: str) -> dict[str, float | None]:
    if device != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    import torch

    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB, "pools": pool_breakdown()}


def pool_breakdown() -> dict[str, float]:
    """Reserved and allocated GiB now, in the ordinary pool and in CUDA graphs' private pools (where the
    reserved bytes that no tensor uses sit)."""
    import torch

    totals = {"reserved": 0.0, "allocated": 0.0, "graph_reserved": 0.0, "graph_allocated": 0.0,
              "graph_pools": 0}
    pools = set()
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:  # backend:cudaMallocAsync keeps no segments
        return {}
    for segment in segments:
        private = tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        totals["reserved"] += segment["total_size"] / GIB
        totals["allocated"] += segment["allocated_size"] / GIB
        if private:
            pools.add(tuple(segment["segment_pool_id"]))
            totals["graph_reserved"] += segment["total_size"] / GIB
            totals["graph_allocated"] += segment["allocated_size"] / GIB
    totals["graph_pools"] = len(pools)
    return totals


def callback_ms(times: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) * 1e3 if gaps else None


def sluice_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch_at = time.time()

    import app.cli
    from engine.graph.document import Workflow
    from engine.graph.executor import Executor
    from engine.settings import Settings, cache_dir
    from engine.telemetry import EventBus
    from nodes.registry import default_registry

    workdir = Path(spec["workdir"])
    settings = Settings(workdir / "models", workdir / "output", None)
    registry = default_registry(settings)
    imported = time.time() - SPAWNED_AT
    cache = cache_dir()
    cache_files = sum(1 for p in cache.rglob("*") if p.is_file()) if cache and cache.exists() else 0
    device, steps, side = spec["device"], spec["steps"], spec["side"]
    if spec["tiny"]:
        torch.set_num_threads(1)  # tiny kernels: threads add only noise on a shared CPU

    workflow = Workflow()
    add = workflow.add_node
    checkpoint = add("CheckpointLoaderSimple", {"ckpt_name": f"{spec['model']}.safetensors"}).id
    positive = add("CLIPTextEncode", {"text": PROMPTS[0]}).id
    negative = add("CLIPTextEncode", {"text": NEGATIVE}).id
    latent = add("EmptyLatentImage", {"width": side, "height": side, "batch_size": 1}).id
    sampler = add("KSampler", {"seed": 0, "steps": steps, "cfg": CFG, "sampler_name": SAMPLER,
                               "scheduler": SCHEDULER, "denoise": 1.0}).id
    decode = add("VAEDecode", {}).id
    save = add("SaveImage", {"filename_prefix": f"e2e_{spec['model']}"}).id
    for source, output, target, name, kind in (
            (checkpoint, 1, positive, "clip", "CLIP"), (checkpoint, 1, negative, "clip", "CLIP"),
            (checkpoint, 0, sampler, "model", "MODEL"), (positive, 0, sampler, "positive", "CONDITIONING"),
            (negative, 0, sampler, "negative", "CONDITIONING"),
            (latent, 0, sampler, "latent_image", "LATENT"),
            (sampler, 0, decode, "samples", "LATENT"), (checkpoint, 2, decode, "vae", "VAE"),
            (decode, 0, save, "images", "IMAGE")):
        workflow.connect(source, output, target, name, kind)
    if spec["budget"] is not None:
        gib = spec["budget"] * TINY_BUDGET_SCALE if spec["tiny"] else spec["budget"]
        workflow.settings["memory"] = {"max_vram": f"cpu={gib:.6f}" if device == "cpu" else f"{gib:g}"}
    app.cli.configure_memory(argparse.Namespace(), workflow)  # as `sluice run` applies settings.memory

    diagnose = Diagnosis(spec)
    bus = EventBus()
    clock = Clock(device)
    bus.subscribe(clock)
    executor = Executor(registry.get, bus=bus, settings=settings)
    result: dict[str, Any] = {"import_s": imported, "after_torch_s": SPAWNED_AT + imported - torch_at,
                              "cache_files": cache_files, "runs": [], "saved_at": []}
    for index in range(1 + spec["warm_runs"]):
        workflow.nodes[positive].widgets["text"] = PROMPTS[index % len(PROMPTS)]
        workflow.nodes[sampler].widgets["seed"] = index
        clock.seconds, clock.callbacks, clock.saved_at = {}, [], None
        if device == "cuda" and index > 0:
            torch.cuda.reset_peak_memory_stats()
        diagnose.before(index)
        began = clock.now()
        job = executor.run(workflow)
        ended = clock.now()
        diagnose.after(index)
        if job.status != "finished":
            failure = job.failure
            result["error"] = (f"{failure.node_type}: {failure.exception_type}: {failure.message}"
                               if failure is not None else f"job {job.status}: {job.errors}")
            break
        s = clock.seconds
        run = {"image_s": ended - began, "text_s": s.get("CLIPTextEncode"), "sampling_s": s.get("KSampler"),
               "step_s": s.get("KSampler", 0.0) / steps, "callback_ms": callback_ms(clock.callbacks),
               "decode_s": s.get("VAEDecode"), "load_s": s.get("CheckpointLoaderSimple"), **peaks(device)}
        result["runs"].append(run)
        result["saved_at"].append(clock.saved_at)
        note(f"{'cold' if index == 0 else 'warm'} {index}: {run['image_s']:.3f} s/image, "
             f"{run['step_s'] * 1e3:.2f} ms/step"
             + (f", pools now {run['pools']}" if run.get("pools") else ""))
    if spec["unet_only"] and "error" not in result:
        executor.clear_cache()
        result["unet_step_s"] = unet_only_step(spec)
    return result


class Diagnosis:
    """--profile: cProfile of the cold generation and of the first warm one (the 40 costliest functions by
    cumulative and by own time); --memory-history: torch's allocation history over the last generation,
    and the blocks alive at its peak of allocated bytes, by the Sluice source line that allocated them.
    Both write text files under --out and say their names."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.profile_runs = spec, (0, 1) if spec.get("profile") else ()
        self.recording = bool(spec.get("memory_history")) and spec["device"] == "cuda"
        self.last_run = spec["warm_runs"]
        self.stem = Path(spec["out"]) / f"diagnosis_{spec['model']}_{spec['mode'].replace(' ', '_')}"
        self.profiler: Any = None
        self.run_starts: list[int] = []  # the trace's length when each generation began
        self.reserved_at_start = 0

    def before(self, index: int) -> None:
        if index == 0 and self.recording:
            import torch

            self.reserved_at_start = torch.cuda.memory_reserved()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        if self.recording:
            import torch

            self.run_starts.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))
        if index == self.last_run and self.recording:
            import torch

            self.last_run_event = len(torch.cuda.memory._snapshot()["device_traces"][0])
        if index in self.profile_runs:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def after(self, index: int) -> None:
        if self.profiler is not None:
            import io
            import pstats

            self.profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(self.profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(40)
            self.profiler = None
            path = Path(f"{self.stem}_profile_{'cold' if index == 0 else 'warm'}.txt")
            path.write_text(text.getvalue())
            note(f"profile written to {path}")
        if index == self.last_run and self.recording:
            import torch

            from engine.memory.runtime import get_runtime

            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            ledgers = get_runtime().snapshot().get("devices", {})
            path = Path(f"{self.stem}_memory.txt")
            path.write_text("\n".join((
                "the whole process (cold and warm generations):", live_at_peak(snapshot, 0),
                "the last generation:", live_at_peak(snapshot, self.last_run_event),
                reserved_peaks(snapshot, self.reserved_at_start, self.run_starts),
                live_now(snapshot), f"allocated now {torch.cuda.memory_allocated() / 2**20:.1f} MiB",
                "ledgers: " + json.dumps(ledgers, default=str)[:4000],
                segment_summary(torch.cuda.memory_stats()))))
            note(f"memory history written to {path}")


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frames in Sluice's code (engine/, nodes/, app/), after the innermost frame of all."""
    ours = [f for f in frames if any(f"/{p}/" in f["filename"] for p in ("engine", "nodes", "app"))]
    if not ours:
        return "outside sluice: " + " < ".join(f"{Path(f['filename']).name}:{f['line']}" for f in frames[:3])
    inner = f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}"
    where = [f"{Path(f['filename']).parent.name}/{Path(f['filename']).name}:{f['line']} {f['name']}"
             for f in ours[:3]]
    return inner + " | " + " < ".join(where)


def live_now(snapshot: dict[str, Any]) -> str:
    """Every allocated block now, grouped by allocating site (blocks from before the recording: no site)."""
    sites: dict[str, list[int]] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                sites.setdefault(_site(block.get("frames", [])), []).append(block["size"])
    lines = ["allocated blocks after the last generation, by site:"]
    for site, sizes in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append(f"  {sum(sizes) / 2**20:9.1f} MiB  {len(sizes):5d} blocks  {site}")
    return "\n".join(lines)


def live_at_peak(snapshot: dict[str, Any], first_event: int) -> str:
    """The blocks alive when the allocations recorded from `first_event` on peaked, by allocating site."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            current += e["size"]
        elif e["action"] == "free_completed":
            current -= e["size"]
        if current > peak and i >= first_event:
            peak, peak_index = current, i
    for e in events[:peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    sites: dict[str, list[int]] = {}
    for e in live.values():
        sites.setdefault(_site(e.get("frames", [])), []).append(e["size"])
    lines = [f"peak {peak / 2**20:.1f} MiB above the allocated bytes when the recording began, {len(live)} "
             "blocks alive then, by site:"]
    for site, sizes in sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append(f"  {sum(sizes) / 2**20:9.1f} MiB  {len(sizes):5d} blocks  {site}")
    return "\n".join(lines)


def reserved_peaks(snapshot: dict[str, Any], reserved_at_start: int, run_starts: list[int]) -> str:
    """Reserved bytes over each generation, from the allocator's segment events (mapped and unmapped pages
    with expandable segments, whole segments without): the peak, the allocated bytes then, and the
    allocation whose new segment or pages set the peak, by source line."""
    events = snapshot["device_traces"][0]
    grow, shrink = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
    bounds = [*run_starts, len(events)]
    reserved, allocated = reserved_at_start, 0
    lines = ["reserved memory by generation (0 = cold):"]
    for run, (start, stop) in enumerate(itertools.pairwise(bounds)):
        peak, at, allocated_then = reserved, None, allocated
        for e in events[start:stop] if run else events[:stop]:
            if e["action"] in grow:
                reserved += e["size"]
            elif e["action"] in shrink:
                reserved -= e["size"]
            elif e["action"] == "alloc":
                allocated += e["size"]
            elif e["action"] == "free_completed":
                allocated -= e["size"]
            if reserved > peak:
                peak, at, allocated_then = reserved, e, allocated
        where = _site(at.get("frames", [])) if at is not None else "(reserved before the generation)"
        cause = f"a {at['action']} of {at['size'] / 2**20:.1f} MiB" if at is not None else "nothing new"
        lines.append(f"  run {run}: reserved peak {peak / 2**30:.3f} GiB with {allocated_then / 2**30:.3f} "
                     f"GiB allocated since the recording began; set by {cause} at {where}")
    return "\n".join(lines)


def segment_summary(stats: dict[str, Any]) -> str:
    keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "reserved_bytes.all.current",
            "inactive_split_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_ooms")
    return "memory_stats: " + ", ".join(
        f"{k} {stats.get(k, 0) / 2**20:.1f} MiB" if "bytes" in k else f"{k} {stats.get(k, 0)}" for k in keys)


def unet_only_step(spec: dict[str, Any]) -> float:
    """bench/memory.py's sluice resident row for the checkpoint's UNet (detected from its shapes): seconds."""
    import gc

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import memory

    from engine.models import loader
    from engine.models.detect import detect

    loader.clear_cache()
    gc.collect()
    if spec["device"] == "cuda":
        torch.cuda.empty_cache()
    size = "tiny" if spec["tiny"] else "full"
    config = detect(tests_helpers().checkpoint_shapes(spec["family"], size)).unet
    device = torch.device(spec["device"])
    dtype = torch.float32 if spec["tiny"] else torch.float16
    weights = memory.random_weights(config, dtype, device)
    inputs = memory.unet_inputs(config, spec["side"] // 8, dtype, device)
    ms = memory.sluice_run(config, weights, inputs, device, "device", None, 3 if spec["tiny"] else 10,
                           5 if spec["tiny"] else 20)[0]
    return ms / 1e3


def diffusers_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    imported = time.time() - SPAWNED_AT
    device, steps, side = spec["device"], spec["steps"], spec["side"]
    dtype = torch.float32 if spec["tiny"] else torch.float16
    if spec["tiny"]:
        torch.set_num_threads(1)
    workdir = Path(spec["workdir"])
    pipeline_class = StableDiffusionXLPipeline if spec["family"] == "sdxl" else StableDiffusionPipeline
    output = workdir / "output"
    output.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"import_s": imported, "runs": [], "saved_at": []}
    for index in range(1 + spec["warm_runs"]):
        if device == "cuda" and index > 0:
            torch.cuda.reset_peak_memory_stats()
        began = synchronized(device)
        if index == 0:
            pipe = pipeline_class.from_single_file(
                str(workdir / "models" / "checkpoints" / f"{spec['model']}.safetensors"),
                config=str(workdir / "diffusers" / spec["model"]), local_files_only=True, torch_dtype=dtype)
            pipe.set_progress_bar_config(disable=True)
            if spec["mode"] == "model cpu offload":
                pipe.enable_model_cpu_offload()
            else:
                pipe.to(device)
            marks = PhaseMarks(pipe, device)
        loaded = synchronized(device)
        marks.reset()
        image = pipe(PROMPTS[index % len(PROMPTS)], negative_prompt=NEGATIVE, height=side, width=side,
                     num_inference_steps=steps, guidance_scale=CFG,
                     generator=torch.Generator("cpu").manual_seed(index), callback_on_step_end=marks.on_step,
                     output_type="pil").images[0]
        decoded = synchronized(device)
        image.save(output / f"e2e_diffusers_{spec['model']}_{index}.png")
        saved = synchronized(device)
        result["saved_at"].append(time.time())
        sampling = marks.decode_at - marks.sampling_at
        run = {"image_s": saved - began, "load_s": loaded - began if index == 0 else None,
               "text_s": marks.sampling_at - loaded, "sampling_s": sampling, "step_s": sampling / steps,
               "callback_ms": callback_ms(marks.callbacks), "decode_s": decoded - marks.decode_at,
               **peaks(device)}
        result["runs"].append(run)
        note(f"{'cold' if index == 0 else 'warm'} {index}: {run['image_s']:.3f} s/image, "
             f"{run['step_s'] * 1e3:.2f} ms/step"
             + (f", pools now {run['pools']}" if run.get("pools") else ""))
    return result


class PhaseMarks:
    """When the pipeline's prompt encoding returns and its VAE decode begins (after a device sync): wrappers
    on the instances' methods, which accelerate's offload hooks leave alone; and the step callbacks' times."""

    def __init__(self, pipe: Any, device: str) -> None:
        self.device = device
        encode_prompt, decode = pipe.encode_prompt, pipe.vae.decode
        self.reset()

        def marked_encode_prompt(*args: Any, **kwargs: Any) -> Any:
            encoded = encode_prompt(*args, **kwargs)
            self.sampling_at = synchronized(device)
            return encoded

        def marked_decode(*args: Any, **kwargs: Any) -> Any:
            if self.decode_at is None:
                self.decode_at = synchronized(device)
            return decode(*args, **kwargs)

        pipe.encode_prompt, pipe.vae.decode = marked_encode_prompt, marked_decode

    def reset(self) -> None:
        self.sampling_at: float | None = None
        self.decode_at: float | None = None
        self.callbacks: list[float] = []

    def on_step(self, pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        self.callbacks.append(time.perf_counter())
        return kwargs


def synchronized(device: str) -> float:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def child(text: str) -> int:
    spec = json.loads(text)
    sys.path.insert(0, str(ROOT))
    if spec.get("log_level"):
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f %(name)s %(message)s")
        logging.getLogger("sluice").setLevel(spec["log_level"])
    try:
        result = diffusers_child(spec) if spec["system"] == "diffusers" else sluice_child(spec)
    except Exception as error:  # noqa: BLE001 - the parent reports it as the mode's row
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoints, float32, 64x64, 2 steps, CPU")
    parser.add_argument("--models", default="sd15,sdxl", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--budgets", default="1,2,4", help="--max-vram budgets in GiB ('' = none)")
    parser.add_argument("--steps", type=int, default=20, help="sampling steps (--tiny: 2)")
    parser.add_argument("--warm-runs", type=int, default=3, help="warm generations per mode (the median)")
    parser.add_argument("--no-cold", action="store_true", help="leave the cold (first in process) rows out")
    parser.add_argument("--no-diffusers", action="store_true", help="leave diffusers' rows out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", default="/tmp/sluice_e2e",
                        help="checkpoints (kept and reused), diffusers configs, profile caches and images")
    parser.add_argument("--child-timeout", type=int, default=300, help="seconds one mode's process may take")
    parser.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING"),
                        help="log Sluice's loggers at this level; each child's stderr is kept in --out")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile Sluice's cold and first warm generation (text files in --out)")
    parser.add_argument("--memory-history", action="store_true",
                        help="record CUDA allocations over Sluice's last generation; list those alive at "
                             "the peak by source line (text files in --out)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    if args.warm_runs < 1 and args.no_cold:
        parser.error("--no-cold with --warm-runs 0 leaves nothing to measure")
    sys.path.insert(0, str(ROOT))
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

