import pytest

from app.gui_words import gui_message
from engine.memory.ledger import BudgetExceeded
from engine.memory.segment_plan import plan_segments
from engine.models.staged import Stage
from engine.telemetry import Event


@pytest.mark.parametrize(
    ("engine_text", "gui_text"),
    [
        ("cannot fit on its own: ...; raise --max-vram or free device memory",
         "cannot fit on its own: ...; raise the VRAM budget (Devices view) or free device memory"),
        ("bad --max-vram value '6GB' in '6GB' in --max-vram '6GB'",
         "bad VRAM budget value '6GB' in '6GB' in VRAM budget '6GB'"),
        ("disk is a parameter residency mode, not a compute backend: 'disk' in --backend 'disk'; use "
         "--params-backend disk",
         "disk is a parameter residency mode, not a compute backend: 'disk' in where it computes 'disk'; use "
         "where weights rest disk"),
        ("params_backend: 'dsk' is not one of the choices",
         "where weights rest: 'dsk' is not one of the choices"),
        ("backend: unknown device 'tpu3'", "where it computes: unknown device 'tpu3'"),
    ],
)
def test_engine_messages_read_in_the_guis_words(engine_text, gui_text):
    assert gui_message(engine_text) == gui_text


def test_a_real_budget_error_names_no_flag_in_the_gui():
    weights = [{"w": 4096}]
    with pytest.raises(BudgetExceeded) as error:
        plan_segments([Stage("block", (), lambda state: state)], weights, 0, 1024)
    assert "--max-vram" in str(error.value)
    assert "--" not in gui_message(str(error.value)) and "VRAM budget" in gui_message(str(error.value))


def test_run_errors_reach_the_nodes_in_the_guis_words(qtbot, make_window):
    window = make_window()
    window.scene.add_node("GuiNumber", (0, 0))
    node_id = next(iter(window.scene.workflow.nodes))
    window.runs.on_event(Event("node_failed", 0.0, {
        "node_id": node_id, "exception_type": "BudgetExceeded",
        "message": "stage 'x' cannot fit on its own; raise --max-vram or free device memory"}))
    message = window.runs.node_errors[node_id][0]
    assert message == ("BudgetExceeded: stage 'x' cannot fit on its own; raise the VRAM budget "
                       "(Devices view) or free device memory")
    assert window.scene.node_items[node_id].errors == [message]
