"""bench/ as issue 24 asks: at most about eight programs, each in bench/README.md with its command, each
drawing its table through bench/plots.py, whose panels carry the values they are given."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import plots  # noqa: E402


def programs() -> list[Path]:
    """bench/'s Python files that run as programs (an `if __name__ == "__main__"` block)."""
    return sorted(path for path in BENCH.glob("*.py") if '__name__ == "__main__"' in path.read_text())


def test_bench_holds_at_most_eight_programs_each_documented_with_its_command():
    found = programs()
    assert 1 <= len(found) <= 8, [path.name for path in found]
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    for path in found:
        assert re.search(rf"^\| `{path.name}` \| `python3 bench/{path.name}", readme, re.MULTILINE), path.name


def test_every_program_draws_through_the_plotting_helper():
    for path in programs():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module == "plots" for alias in node.names}
        assert "draw" in imported, f"{path.name} does not import plots.draw"
        called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name)}
        assert "draw" in called, f"{path.name} never calls draw"


def widths(image: Image.Image, color: str) -> list[int]:
    """Per pixel row of `image`, how many of its pixels are `color`."""
    rgb = tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
    pixels = image.convert("RGB").load()
    return [sum(pixels[x, y] == rgb for x in range(image.width)) for y in range(image.height)]


def bar_lengths(image: Image.Image, color: str) -> list[int]:
    """The length of each bar of `color`, top to bottom: runs of rows wider than the legend's 14-pixel box."""
    lengths, previous = [], 0
    for width in widths(image, color):
        if width > 20 and previous <= 20:
            lengths.append(width)
        previous = width
    return lengths


def test_a_bar_panel_draws_each_value_in_proportion_and_leaves_a_missing_one_out(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the Pillow drawing, which is always there
    panel = plots.Panel("seconds", "s", categories=["short", "long", "failed"],
                        bars=[plots.Bars("run", [1.0, 3.0, None])])
    with Image.open(plots.draw(tmp_path / "bars.png", [panel], "title")) as image:
        short, long = bar_lengths(image, plots.COLORS[0])  # the missing value draws no bar
    assert long == pytest.approx(3 * short, rel=0.05)


def test_a_line_panel_and_two_panels_a_row(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = plots.Panel("RSS", "prompts", "MiB", y_from_zero=True,
                       lines=[plots.Line("RSS", [(1, 900.0), (2, 901.0), (3, 900.5)])])
    path = plots.draw(tmp_path / "lines.png", [line, line, line])
    with Image.open(path) as image:
        assert image.width == 2 * plots.PANEL_WIDTH and image.height > 2 * 400  # two rows of panels
        assert sum(widths(image, plots.COLORS[0])) > 0  # the line and its points


@pytest.mark.parametrize(("panel", "says"), [
    (plots.Panel("t", "x", categories=["a", "b"], bars=[plots.Bars("s", [1.0])]),
     "1 values for 2 categories"),
    (plots.Panel("t", "x", lines=[plots.Line("l", [(0, 1)], "wavy")]), "style 'wavy'"),
])
def test_a_malformed_panel_is_an_error_naming_it(tmp_path, panel, says):
    with pytest.raises(ValueError, match=f"panel 't'.*{says}"):
        plots.draw(tmp_path / "bad.png", [panel])
