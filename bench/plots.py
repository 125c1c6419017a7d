"""The bench programs' plots (a helper they import, not a program): one PNG of panels, drawn with matplotlib
when it is importable, else with Pillow (plainer, the same content).

A panel is either lines (x, y points: a measured series, a reference line, markers alone) or horizontal bars
(one group per category, one bar per series, with optional whiskers and an optional limit per category such
as a memory budget, drawn as a black tick across the group). Every bar carries its value as text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
STYLES = ("line", "dashed", "dotted", "points")  # Line.style: dashed and dotted are reference lines


@dataclass
class Line:
    label: str
    points: list[tuple[float, float]]
    style: str = "line"


@dataclass
class Bars:
    label: str
    values: list[float | None]  # one per category of the panel; None: no bar (not measured, failed)
    ranges: list[tuple[float, float] | None] | None = None  # per bar, a whisker: (minimum, maximum)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str = ""  # line panels only (a bar panel's rows are its categories)
    y_from_zero: bool = False  # line panels: the y axis starts at 0 (a small change is not blown up)
    lines: list[Line] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    bars: list[Bars] = field(default_factory=list)
    limits: list[float | None] | None = None  # per category: a limit the bars are read against
    limit_label: str = "limit"
    note: str = ""  # one line under the title: what is left out of the panel and why


def draw(path: Path, panels: list[Panel], title: str = "") -> Path:
    """`panels` (two a row) as one PNG at `path`; returns `path`."""
    if not panels:
        raise ValueError(f"{path.name}: no panels to draw")
    for panel in panels:
        _check(panel)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _draw_with_pillow(path, panels, title)
    else:
        _draw_with_matplotlib(plt, path, panels, title)
    return path


def _check(panel: Panel) -> None:
    if panel.lines and panel.bars:
        raise ValueError(f"panel {panel.title!r}: lines and bars at once; accepted: one kind per panel")
    for line in panel.lines:
        if line.style not in STYLES:
            raise ValueError(f"panel {panel.title!r}, line {line.label!r}: style {line.style!r}; accepted: "
                             f"{', '.join(STYLES)}")
    for bars in panel.bars:
        for name, values in (("values", bars.values), ("ranges", bars.ranges), ("limits", panel.limits)):
            if values is not None and len(values) != len(panel.categories):
                raise ValueError(f"panel {panel.title!r}, bars {bars.label!r}: {len(values)} {name} for "
                                 f"{len(panel.categories)} categories; accepted: one per category")


def _measured(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _text(value: float) -> str:
    """A value as a bar's label: three significant digits, whole numbers from 1000 on (no exponent)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _bar_height(panel: Panel) -> float:
    """Inches of a bar panel: a third of an inch per bar, at least three."""
    return max(3.0, 0.9 + len(panel.categories) * (len(panel.bars) * 0.22 + 0.15))


# ----------------------------------------------------------------------------------------------- matplotlib


def _draw_with_matplotlib(plt: object, path: Path, panels: list[Panel], title: str) -> None:
    columns = min(2, len(panels))
    rows = [panels[i:i + columns] for i in range(0, len(panels), columns)]
    heights = [max(_bar_height(p) if p.bars else 4.0 for p in row) for row in rows]
    figure, axes = plt.subplots(len(rows), columns, figsize=(7.5 * columns, sum(heights) + 0.4 * bool(title)),
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    for row_index, row in enumerate(rows):
        for column in range(columns):
            axis = axes[row_index][column]
            if column >= len(row):
                axis.set_visible(False)
                continue
            panel = row[column]
            (_matplotlib_bars if panel.bars else _matplotlib_lines)(axis, panel)
            axis.set_title(panel.title + (f"\n{panel.note}" if panel.note else ""), fontsize=10)
            axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _matplotlib_lines(axis: object, panel: Panel) -> None:
    formats = {"line": "-o", "dashed": "--", "dotted": ":", "points": "o"}
    for index, line in enumerate(panel.lines):
        xs, ys = [x for x, _ in line.points], [y for _, y in line.points]
        color = COLORS[index % len(COLORS)] if line.style in ("line", "points") else "black"
        axis.plot(xs, ys, formats[line.style], color=color, label=line.label,
                  markersize=3 if len(xs) > 30 else 5)
    axis.set(xlabel=panel.xlabel, ylabel=panel.ylabel)
    if all(float(x).is_integer() for line in panel.lines for x, _ in line.points):  # counts: whole ticks
        from matplotlib.ticker import MaxNLocator

        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    highest = max((y for line in panel.lines for _, y in line.points if _measured(y)), default=0.0)
    if panel.y_from_zero and highest > 0:
        axis.set_ylim(0, highest * 1.1)
    if panel.lines:
        axis.legend(fontsize=7)


def _matplotlib_bars(axis: object, panel: Panel) -> None:
    count = len(panel.bars)
    height = 0.8 / count
    for index, bars in enumerate(panel.bars):
        ys = [c + (index - (count - 1) / 2) * height for c in range(len(panel.categories))]
        kept = [(y, v, r) for y, v, r in zip(ys, bars.values, bars.ranges or [None] * len(ys), strict=True)
                if _measured(v)]
        if not kept:
            continue
        errors = None
        if any(r is not None for _, _, r in kept):
            errors = [[v - r[0] if r else 0 for _, v, r in kept], [r[1] - v if r else 0 for _, v, r in kept]]
        axis.barh([y for y, _, _ in kept], [v for _, v, _ in kept], height * 0.9, xerr=errors, capsize=2,
                  color=COLORS[index % len(COLORS)], label=bars.label)
        for y, value, spread in kept:  # the value beyond the bar and its whisker
            end = max(value, spread[1]) if spread else value
            axis.text(end, y, " " + _text(value), va="center", fontsize=7)
    if panel.limits:
        first = True
        for category, limit in enumerate(panel.limits):
            if _measured(limit):
                axis.vlines(limit, category - 0.45, category + 0.45, colors="black", linewidth=2,
                            label=panel.limit_label if first else None)
                first = False
    axis.set_yticks(range(len(panel.categories)), panel.categories, fontsize=8)
    axis.invert_yaxis()  # the first category on top, as in the program's table
    axis.set_xlabel(panel.xlabel)
    axis.margins(x=0.15)
    axis.legend(fontsize=7)


# --------------------------------------------------------------------------------------------------- Pillow

PANEL_WIDTH, DPI = 760, 100  # pixels of one panel; pixels per inch of a bar panel's height


def _draw_with_pillow(path: Path, panels: list[Panel], title: str) -> None:
    from PIL import Image

    images = [_pillow_panel(panel) for panel in panels]
    columns = min(2, len(images))
    rows = [images[i:i + columns] for i in range(0, len(images), columns)]
    top = 30 if title else 0
    heights = [max(image.height for image in row) for row in rows]
    sheet = Image.new("RGB", (PANEL_WIDTH * columns, top + sum(heights)), "white")
    y = top
    for row, height in zip(rows, heights, strict=True):
        for column, image in enumerate(row):
            sheet.paste(image, (column * PANEL_WIDTH, y))
        y += height
    if title:
        from PIL import ImageDraw

        ImageDraw.Draw(sheet).text((10, 8), title, fill="black", font=_font(15))
    sheet.save(path)


def _font(size: int) -> object:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1: one bitmap size
        return ImageFont.load_default()


def _ticks(low: float, high: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2, 2.5 or 5 times a power of ten (at least 1 when
    `whole`: counts)."""
    if not high > low:
        low, high = (low - 1, high + 1) if low == 0 else (low - abs(low) * 0.1, high + abs(high) * 0.1)
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    step = max(step, 1) if whole else step
    first, last = math.floor(low / step), math.ceil(high / step)
    return [i * step for i in range(first, last + 1)]


def _tick_text(value: float, step: float) -> str:
    """`value` with as many decimals as the tick step has (2.5 x 10^k has one more)."""
    decimals = max(0, -math.floor(math.log10(step)))
    scaled = step * 10**decimals
    return f"{value:.{decimals + (abs(scaled - round(scaled)) > 1e-6)}f}"


def _legend(draw: object, entries: list[tuple[str, str, str]], x0: int, y: int, width: int,
            font: object) -> int:
    """Entries (label, colour, kind: box or line) flowing left to right from (x0, y); returns the y below."""
    x = x0
    for label, color, kind in entries:
        size = 22 + draw.textlength(label, font=font) + 16
        if x + size > x0 + width and x > x0:
            x, y = x0, y + 18
        if kind == "box":
            draw.rectangle([x, y + 3, x + 14, y + 13], fill=color)
        else:
            _pillow_line(draw, [(x, y + 8), (x + 16, y + 8)], color, kind)
        draw.text((x + 20, y), label, fill="black", font=font)
        x += size
    return y + 20


def _legend_rows(draw: object, labels: list[str], width: int, font: object) -> int:
    """How many rows _legend takes for `labels` within `width` pixels."""
    rows, x = 1, 0.0
    for label in labels:
        size = 22 + draw.textlength(label, font=font) + 16
        if x + size > width and x > 0:
            rows, x = rows + 1, 0.0
        x += size
    return rows


def _pillow_line(draw: object, points: list[tuple[float, float]], color: str, style: str) -> None:
    if style == "line":
        draw.line(points, fill=color, width=2)
        return
    dash, gap = (8, 5) if style == "dashed" else (2, 4)
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        length = math.hypot(x1 - x0, y1 - y0)
        at = 0.0
        while at < length:
            end = min(at + dash, length)
            draw.line([(x0 + (x1 - x0) * at / length, y0 + (y1 - y0) * at / length),
                       (x0 + (x1 - x0) * end / length, y0 + (y1 - y0) * end / length)], fill=color, width=2)
            at = end + gap


def _pillow_panel(panel: Panel) -> object:
    from PIL import Image, ImageDraw

    font, small = _font(13), _font(11)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    if panel.bars:
        left = 16 + min(300, max((probe.textlength(c, font=small) for c in panel.categories), default=0))
        height = int(_bar_height(panel) * DPI)
    else:
        left, height = 70, 420
    labels = [bars.label for bars in panel.bars] + [line.label for line in panel.lines]
    labels += [panel.limit_label] if panel.limits else []
    legend_rows = _legend_rows(probe, labels, PANEL_WIDTH - 60 - int(left), small)
    image = Image.new("RGB", (PANEL_WIDTH, height + 22 * bool(panel.note) + 18 * (legend_rows - 1)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 6), panel.title, fill="black", font=font)
    top = 30
    if panel.note:
        draw.text((10, top), panel.note, fill="dimgrey", font=small)
        top += 22
    if panel.lines:  # the y axis's label above the axis
        draw.text((10, top), panel.ylabel, fill="black", font=small)
        top += 22
    box = (int(left), top, PANEL_WIDTH - 60, image.height - 50 - 18 * legend_rows)
    draw.rectangle(box, outline="black")
    if panel.bars:
        entries = _pillow_bars(draw, panel, box, small)
    else:
        entries = _pillow_lines(draw, panel, box, small)
    draw.text((box[0], box[3] + 20), panel.xlabel, fill="black", font=small)
    draw.rectangle(box, outline="black")  # over the grid lines at its edges
    _legend(draw, entries, box[0], box[3] + 38, box[2] - box[0], small)
    return image


def _scale(low: float, high: float, pixel_low: float, pixel_high: float) -> object:
    return lambda value: pixel_low + (pixel_high - pixel_low) * (value - low) / (high - low)


def _x_axis(draw: object, ticks: list[float], to_x: object, box: tuple[int, int, int, int], font: object,
            ) -> None:
    step = ticks[1] - ticks[0]
    for tick in ticks:
        x = to_x(tick)
        draw.line([(x, box[3]), (x, box[3] + 4)], fill="black")
        draw.line([(x, box[1]), (x, box[3])], fill="#e8e8e8")
        text = _tick_text(tick, step)
        draw.text((x - draw.textlength(text, font=font) / 2, box[3] + 5), text, fill="black", font=font)


def _pillow_lines(draw: object, panel: Panel, box: tuple[int, int, int, int], font: object,
                  ) -> list[tuple[str, str, str]]:
    points = [p for line in panel.lines for p in line.points if _measured(p[0]) and _measured(p[1])]
    if not points:
        draw.text((box[0] + 10, box[1] + 10), "nothing measured", fill="black", font=font)
        return []
    low = 0.0 if panel.y_from_zero else min(y for _, y in points)
    whole = all(float(x).is_integer() for x, _ in points)
    xs = _ticks(min(x for x, _ in points), max(x for x, _ in points), whole=whole)
    ys = _ticks(min(low, min(y for _, y in points)), max(y for _, y in points))
    to_x = _scale(xs[0], xs[-1], box[0] + 8, box[2] - 8)
    to_y = _scale(ys[0], ys[-1], box[3] - 8, box[1] + 8)
    _x_axis(draw, xs, to_x, box, font)
    for tick in ys:
        y = to_y(tick)
        draw.line([(box[0] - 4, y), (box[0], y)], fill="black")
        draw.line([(box[0], y), (box[2], y)], fill="#e8e8e8")
        text = _tick_text(tick, ys[1] - ys[0])
        draw.text((box[0] - 6 - draw.textlength(text, font=font), y - 7), text, fill="black", font=font)
    entries = []
    for index, line in enumerate(panel.lines):
        color = COLORS[index % len(COLORS)] if line.style in ("line", "points") else "black"
        pixels = [(to_x(x), to_y(y)) for x, y in line.points if _measured(x) and _measured(y)]
        if line.style != "points" and len(pixels) > 1:
            _pillow_line(draw, pixels, color, line.style)
        if line.style in ("line", "points"):
            radius = 2 if len(pixels) > 30 else 4
            for x, y in pixels:
                draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=color)
        entries.append((line.label, color, "box" if line.style == "points" else line.style))
    return entries


def _pillow_bars(draw: object, panel: Panel, box: tuple[int, int, int, int], font: object,
                 ) -> list[tuple[str, str, str]]:
    highs = [v for bars in panel.bars for v in bars.values if _measured(v)]
    highs += [r[1] for bars in panel.bars for r in bars.ranges or [] if r is not None]
    highs += [v for v in panel.limits or [] if _measured(v)]
    ticks = _ticks(0.0, max(highs, default=1.0) * 1.12 or 1.0)
    to_x = _scale(0.0, ticks[-1], box[0], box[2])
    _x_axis(draw, ticks, to_x, box, font)
    group = (box[3] - box[1]) / max(1, len(panel.categories))
    bar = group * 0.8 / len(panel.bars)
    for category, name in enumerate(panel.categories):
        middle = box[1] + group * (category + 0.5)
        shown = name if draw.textlength(name, font=font) <= box[0] - 12 else name[:40] + "..."
        draw.text((box[0] - 8 - draw.textlength(shown, font=font), middle - 7), shown, fill="black",
                  font=font)
        for index, bars in enumerate(panel.bars):
            value = bars.values[category]
            if not _measured(value):
                continue
            y = middle + (index - (len(panel.bars) - 1) / 2) * bar
            draw.rectangle([box[0], y - bar * 0.45, to_x(value), y + bar * 0.45],
                           fill=COLORS[index % len(COLORS)])
            end = to_x(value)
            spread = bars.ranges[category] if bars.ranges else None
            if spread is not None:
                draw.line([(to_x(spread[0]), y), (to_x(spread[1]), y)], fill="black", width=1)
                end = max(end, to_x(spread[1]))
            draw.text((end + 3, y - 7), _text(value), fill="black", font=font)
        limit = panel.limits[category] if panel.limits else None
        if _measured(limit):
            x = to_x(limit)
            draw.line([(x, middle - group * 0.45), (x, middle + group * 0.45)], fill="black", width=3)
    entries = [(bars.label, COLORS[i % len(COLORS)], "box") for i, bars in enumerate(panel.bars)]
    if panel.limits and any(_measured(v) for v in panel.limits):
        entries.append((panel.limit_label, "black", "line"))
    return entries
