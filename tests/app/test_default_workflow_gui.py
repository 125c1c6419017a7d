"""A new user's first run: the window opens with the default workflow, Queue runs it on the embedded model,
and the generated image (judged automatically) shows in the gallery."""

from PIL import Image

from tools.shapes_dataset import Scene, ShapeSpec
from tools.shapes_judge import judge


def test_default_workflow_opens_runs_and_shows_the_prompted_image(qtbot, make_default_window, screenshot):
    window = make_default_window()
    types = sorted(node.type for node in window.scene.workflow.nodes.values())
    assert types == sorted(["CheckpointLoaderSimple", "CLIPLoader", "CLIPTextEncode", "CLIPTextEncode",
                            "EmptyLatentImage", "KSampler", "VAEDecode", "SaveImage"])
    job_id = window.queue()
    assert job_id is not None
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) in ("finished", "failed"), timeout=120_000)
    assert window.runs.statuses[job_id] == "finished"
    qtbot.waitUntil(lambda: len(window.gallery.paths()) == 1, timeout=10_000)
    image = Image.open(window.gallery.paths()[0])
    assert image.size == (128, 128)
    # The default prompt: "a large yellow star in the center on a blue background".
    expected = Scene("blue", (ShapeSpec("star", "yellow", "large", "center"),))
    assert judge(image, expected) == {"background": True, "color": True, "position": True, "size": True,
                                      "shape": True}
    window.view.fit_to_content()
    screenshot(window, "main_window_default_workflow_run.png")


def test_main_window_after_a_run_at_three_sizes(qtbot, make_default_window, screenshot):
    """Screenshots to look at (tests/artifacts/main_window_run_WxH.png): after a run of the default workflow,
    node text stays readable at every size and the docks keep their share of the window."""
    window = make_default_window(size=(1024, 700))
    job_id = window.queue()
    qtbot.waitUntil(lambda: window.runs.statuses.get(job_id) in ("finished", "failed"), timeout=120_000)
    assert window.runs.statuses[job_id] == "finished"
    qtbot.waitUntil(lambda: len(window.gallery.paths()) == 1, timeout=10_000)
    for width, height in ((1024, 700), (1600, 1000), (2560, 1440)):
        window.resize(width, height)
        qtbot.wait(100)
        window._first_fit()  # as the document was first shown at this size
        qtbot.wait(100)
        zoom = window.view.zoom()
        assert 8.5 * window.view.logicalDpiY() / 72 * zoom >= 9 - 1e-6
        assert window.memory_panel.height() > 0.25 * height  # the memory view grows with the window
        assert not window.memory_panel.throughput_plot.isVisible()  # nothing was copied: no empty plot
        screenshot(window, f"main_window_run_{width}x{height}.png")
