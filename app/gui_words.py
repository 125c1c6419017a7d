"""The GUI's words for placement: what the command line calls `--backend`, `--params-backend` and
`--max-vram`, the window calls "where it computes", "where weights rest" and "VRAM budget"; the flag stays
in a tooltip. `gui_message` rewrites an engine or validation message in those words, so an error shown in
the window never tells a GUI user to "raise --max-vram"."""

from __future__ import annotations

import re

COMPUTES = "where it computes"
RESTS = "where weights rest"
BUDGET = "VRAM budget"

# the value of a loader's params_backend -> what the GUI lists (the order of NODE_PARAMS)
WEIGHT_HOMES = {
    "auto": "auto (auto-fit chooses)",
    "device": "GPU (where it computes)",
    "cpu": "pinned RAM",
    "disk": "disk (re-read each use)",
}
# what a node's placement inputs are called on the canvas (the input's name stays in files and tooltips)
INPUT_LABELS = {"backend": "computes on", "params_backend": "weights rest"}
# a resolved home (engine.placement.NodePlacement.params, or an auto-fit choice) in a sentence
HOME_WORDS = {"device": "where it computes", "cpu": "pinned RAM", "disk": "disk"}

COMPUTES_TIP = (f"{COMPUTES.capitalize()}: the device that runs this model. auto follows the workflow's "
                f"choice in the Devices view (the first GPU by default). Command line: --backend; workflow "
                f"file and node input: backend.")
RESTS_TIP = (f"{RESTS.capitalize()} between uses: on the GPU where it computes, in pinned RAM (copied "
             f"in as it runs), or on disk (re-read from the file). auto lets auto-fit choose from the "
             f"file sizes. Command line: --params-backend; node input: params_backend.")
BUDGET_TIP = (f"{BUDGET}: GiB each GPU may use (a device named with its own value, e.g. cuda0=6 or "
              f"cpu=0.5, gives it a budget of its own; 0: the memory free now; negative: free memory "
              f"minus that many GiB). Command line: --max-vram.")

_REWRITES = (  # longest first: --params-backend before --backend
    (re.compile(r"\braise --max-vram\b"), "raise the VRAM budget (Devices view)"),
    (re.compile(r"--max-vram\b"), BUDGET),
    (re.compile(r"--params-backend\b"), RESTS),
    (re.compile(r"--backend\b"), COMPUTES),
    (re.compile(r"\bparams_backend\b"), RESTS),
    (re.compile(r"^backend(?=:)", re.MULTILINE), COMPUTES),  # a node input's name before its message
    (re.compile(r"\bmax_vram\b"), BUDGET),
)


def gui_message(text: str) -> str:
    """`text` with command-line flags and node input names replaced by the GUI's words."""
    for pattern, words in _REWRITES:
        text = pattern.sub(words, text)
    return text


def home_words(params: str | None, compute: str) -> str:
    """Where a module's weights rest, in words: `device` on a CPU is RAM, on a GPU that GPU."""
    if params is None:
        return "auto-fit decides"
    if params == "device":
        return "RAM" if compute == "cpu" else compute
    return HOME_WORDS.get(params, params)
