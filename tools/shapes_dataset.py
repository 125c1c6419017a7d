"""A deterministic, captioned image set of coloured shapes, rendered on the fly with Pillow.

Each scene is one or two shapes (circle, square, triangle, star, ring, cross) with a colour, a size and a
position on a 3x3 grid, on a plain background. Captions are natural language in the wordings people type
("a large red circle at the top left on a blue background", "blue background, a big red circle top left",
"draw a red circle in the upper left, the background is blue", colour synonyms such as "violet"). Some
colour/shape pairs (HELD_OUT) and some wordings (HELD_OUT_TEMPLATES) are never used in training, so the
judge can measure generalisation. The same index always gives the same scene.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 180),
    "orange": (245, 140, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "star", "ring", "cross")
SIZES = {"small": 0.22, "large": 0.40}  # shape diameter as a fraction of the image side
POSITIONS: dict[str, tuple[float, float]] = {  # centre as fractions of the image side (x, y)
    "top left": (0.25, 0.25),
    "top": (0.5, 0.25),
    "top right": (0.75, 0.25),
    "left": (0.25, 0.5),
    "center": (0.5, 0.5),
    "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75),
    "bottom": (0.5, 0.75),
    "bottom right": (0.75, 0.75),
}
POSITION_PHRASES: dict[str, tuple[str, ...]] = {
    "top left": ("at the top left", "in the top left corner", "in the upper left", "at the top-left",
                 "top left", "in the top left", "in the upper left corner"),
    "top": ("at the top", "at the top center", "in the upper middle", "at the top middle",
            "at the top centre", "top center", "near the top"),
    "top right": ("at the top right", "in the top right corner", "in the upper right", "at the top-right",
                  "top right", "in the top right", "in the upper right corner"),
    "left": ("on the left", "at the left", "on the left side", "to the left", "left", "at the left side",
             "in the middle left", "at the center left"),
    "center": ("in the center", "in the middle", "at the center", "in the centre", "centered", "center",
               "in the very center"),
    "right": ("on the right", "at the right", "on the right side", "to the right", "right",
              "at the right side", "in the middle right", "at the center right"),
    "bottom left": ("at the bottom left", "in the bottom left corner", "in the lower left",
                    "at the bottom-left", "bottom left", "in the bottom left", "in the lower left corner"),
    "bottom": ("at the bottom", "at the bottom center", "in the lower middle", "at the bottom middle",
               "at the bottom centre", "bottom center", "near the bottom"),
    "bottom right": ("at the bottom right", "in the bottom right corner", "in the lower right",
                     "at the bottom-right", "bottom right", "in the bottom right",
                     "in the lower right corner"),
}
# Other words for a colour, each one token of CLIP's vocabulary (engine/models/tokenizer.py), so the text
# encoder can learn it; used now and then in place of the colour's own name.
COLOR_SYNONYMS: dict[str, tuple[str, ...]] = {
    "red": ("crimson", "scarlet"),
    "green": ("emerald",),
    "blue": ("navy",),
    "purple": ("violet",),
    "orange": ("tangerine",),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
# Sentence forms: {body} is the shape phrase(s), {bg} the background colour word, {a_bg} its article.
# PREFIXES go in front of those that start with a noun ("draw a red circle ...", "a picture of a blue
# background with ...").
TRAINING_TEMPLATES = (
    "{body} on {a_bg} {bg} background",
    "{body} on {bg} background",
    "{body}, {bg} background",
    "{body} on {bg}",
    "{body} against {a_bg} {bg} background",
    "{body} with {a_bg} {bg} background",
    "{body}, the background is {bg}",
    "{body}. the background is {bg}",
    "{body} on a background of {bg}",
    "{a_bg} {bg} background with {body}",
    "{bg} background with {body}",
    "{bg} background, {body}",
    "{bg} background and {body}",
    "on {a_bg} {bg} background, {body}",
    "the background is {bg}, {body}",
    "the background is {bg} with {body}",
)
PREFIXES = ("draw ", "a picture of ", "a drawing of ", "an image of ", "picture of ", "please draw ")
# Wordings that training never shows (they reuse its words in new sentences): the judge's "unseen wordings".
HELD_OUT_TEMPLATES = (
    "there is {body} on {a_bg} {bg} background",
    "{body}; {bg} background",
    "background: {bg}. {body}",
    "an image showing {body} over {a_bg} {bg} background",
    "{bg} background. draw {body}",
    "{body} and the background is {bg}",
)
# Colour/shape pairs never shown in training; the judge tests them to measure generalisation.
HELD_OUT: frozenset[tuple[str, str]] = frozenset({
    ("green", "star"), ("red", "triangle"), ("blue", "ring"), ("yellow", "square"), ("purple", "circle"),
})


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    color: str
    size: str
    position: str


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[ShapeSpec, ...]


def _color_word(color: str, rng: random.Random) -> str:
    synonyms = COLOR_SYNONYMS.get(color, ())
    return rng.choice(synonyms) if synonyms and rng.random() < 0.15 else color


def _shape_phrase(spec: ShapeSpec, rng: random.Random, with_size: bool, article: bool) -> str:
    color = _color_word(spec.color, rng)
    words = f"{rng.choice(SIZE_WORDS[spec.size])} {color}" if with_size else color
    position = rng.choice(POSITION_PHRASES[spec.position])
    phrase = f"{words} {spec.shape} {position}"
    return f"{_article(words)} {phrase}" if article else phrase


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(scene: Scene, rng: random.Random, held_out_wording: bool = False) -> str:
    """A natural-language caption of `scene`, phrased at random by `rng`: in one of the training wordings,
    or, with held_out_wording, in one of HELD_OUT_TEMPLATES (which training never uses)."""
    with_size = rng.random() < 0.8
    article = rng.random() < 0.85
    body = " and ".join(_shape_phrase(s, rng, with_size, article) for s in scene.shapes)
    background = _color_word(scene.background, rng)
    if held_out_wording:
        return rng.choice(HELD_OUT_TEMPLATES).format(body=body, bg=background, a_bg=_article(background))
    text = rng.choice(TRAINING_TEMPLATES).format(body=body, bg=background, a_bg=_article(background))
    prefixed = rng.random() < 0.25 and not text.startswith(("the ", "on "))  # not "draw the background is"
    return rng.choice(PREFIXES) + text if prefixed else text


def names_size(text: str) -> bool:
    """Whether a caption says how large its shapes are (the judge checks size only then)."""
    words = set(text.replace(",", " ").replace(".", " ").split())
    return any(word in words for choices in SIZE_WORDS.values() for word in choices)


def random_scene(rng: random.Random, held_out: bool = False, max_shapes: int = 2) -> Scene:
    """A scene; held_out=False avoids every HELD_OUT colour/shape pair, held_out=True uses one first."""
    background = rng.choice(list(COLORS))
    count = 1 if max_shapes == 1 or rng.random() < 0.7 else 2
    shapes: list[ShapeSpec] = []
    used_positions: set[str] = set()
    while len(shapes) < count:
        if held_out and not shapes:
            color, shape = rng.choice(sorted(HELD_OUT))
            if color == background:
                background = rng.choice([c for c in COLORS if c != color])
        else:
            color = rng.choice([c for c in COLORS if c != background])
            shape = rng.choice(SHAPES)
            if (color, shape) in HELD_OUT:
                continue
        free = [p for p in POSITIONS if _apart(p, used_positions)]
        if not free:  # a centred first shape leaves no room for a second
            break
        position = rng.choice(free)
        used_positions.add(position)
        shapes.append(ShapeSpec(shape, color, rng.choice(list(SIZES)), position))
    return Scene(background, tuple(shapes))


def _apart(position: str, used: set[str]) -> bool:
    """Two shapes never sit on neighbouring grid cells (diagonals included), so they do not overlap."""
    x, y = POSITIONS[position]
    return all(max(abs(x - POSITIONS[u][0]), abs(y - POSITIONS[u][1])) > 0.3 for u in used)


def _star_points(cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * 0.45
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points


def draw_shape(draw: ImageDraw.ImageDraw, spec: ShapeSpec, side: int) -> None:
    cx, cy = (v * side for v in POSITIONS[spec.position])
    draw_outline(draw, spec.shape, cx, cy, SIZES[spec.size] * side / 2, COLORS[spec.color])


def draw_outline(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float,
                 fill: tuple[int, int, int]) -> None:
    """Draw `shape` of radius `r` pixels centred on (cx, cy): the renderer's geometry, any place and size."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
    elif shape == "star":
        draw.polygon(_star_points(cx, cy, r * 1.1), fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, round(r * 0.4)))
    elif shape == "cross":
        t = r * 0.32
        draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
        draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")


def render(scene: Scene, side: int = 128, supersample: int = 4) -> Image.Image:
    """Render `scene` as side x side RGB pixels (drawn larger, then downsampled for smooth edges)."""
    big = side * supersample
    image = Image.new("RGB", (big, big), COLORS[scene.background])
    draw = ImageDraw.Draw(image)
    for spec in scene.shapes:
        draw_shape(draw, spec, big)
    return image.resize((side, side), Image.Resampling.LANCZOS)


def sample(index: int, side: int = 128, held_out: bool = False) -> tuple[Image.Image, str, Scene]:
    """The index-th example: (image, caption, scene). Deterministic in (index, held_out)."""
    rng = random.Random(index * 2 + int(held_out))
    scene = random_scene(rng, held_out=held_out)
    return render(scene, side), caption(scene, rng), scene
