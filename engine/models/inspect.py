"""`sluice inspect FILE`: what a checkpoint holds (family, components, configs, sizes) from its header."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.models.detect import detect
from engine.models.formats import open_checkpoint

VARIANTS = {"flux_dev": "FLUX.1 dev: guidance-distilled",
            "flux_schnell": "FLUX.1 schnell: timestep-distilled"}


def inspect_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Family, components, configs (as dicts), per-component parameters, dtypes and bytes; no weights read."""
    path = Path(path)
    with open_checkpoint(path) as reader:
        info = detect(reader).to_dict()
        file_format, metadata = reader.format, reader.metadata()
    stats = info["stats"]
    return {
        "path": str(path),
        "format": file_format,
        "file_bytes": path.stat().st_size,
        **info,
        "total_parameters": sum(s["parameters"] for s in stats.values()),
        "total_bytes": sum(s["bytes"] for s in stats.values()),
        "metadata": metadata,
    }


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _config_lines(title: str, config: dict[str, Any]) -> list[str]:
    lines = [f"  {title}"]
    lines += [f"    {key:<26} {value}" for key, value in config.items()]
    return lines


def format_inspection(info: dict[str, Any]) -> str:
    """Readable text for a result of `inspect_file`."""
    lines = [
        f"{info['path']}",
        f"  format      {info['format']}, {_size(info['file_bytes'])}",
        f"  family      {info['family']} (layout {info['layout']})",
        f"  parameters  {info['total_parameters']:,} in {_size(info['total_bytes'])}",
        "",
        f"  {'component':<10} {'prefix':<28} {'tensors':>8} {'parameters':>15} {'size':>12}  dtypes",
    ]
    for name, prefix in info["components"].items():
        s = info["stats"][name]
        dtypes = ", ".join(f"{t} x{n}" for t, n in sorted(s["dtypes"].items()))
        lines.append(
            f"  {name:<10} {prefix or '(bare keys)':<28} {s['tensors']:>8} {s['parameters']:>15,} "
            f"{_size(s['bytes']):>12}  {dtypes}"
        )
    other = info["unassigned"]
    if other["tensors"]:
        lines.append(
            f"  {'other':<10} {'':<28} {other['tensors']:>8} {other['parameters']:>15,} "
            f"{_size(other['bytes']):>12}  e.g. {', '.join(info['unassigned_examples'][:3])}"
        )
    lines.append("")
    if info["unet"]:
        lines += _config_lines("UNet", info["unet"])
    if info["flux"]:
        variant = VARIANTS.get(info["family"], info["family"])
        lines += _config_lines(f"FLUX transformer ({variant}, {info['flux_layout']} keys, "
                               f"{info['stats']['diffusion']['parameters']:,} parameters)", info["flux"])
    if info["t5"]:
        lines += _config_lines(f"T5 encoder (under {info['t5_prefix'] or 'bare keys'})", info["t5"])
    if info["vae"]:
        lines += _config_lines("VAE", info["vae"])
    for index, text in enumerate(info["text_encoders"]):
        lines += _config_lines(f"text encoder {index} ({text['kind']})", text)
    if info["metadata"]:
        lines.append("  metadata")
        lines += [f"    {key:<26} {value[:80]}" for key, value in sorted(info["metadata"].items())]
    return "\n".join(lines)
