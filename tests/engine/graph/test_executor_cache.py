import random
import threading

import pytest

from engine.graph.document import Workflow
from engine.graph.executor import Executor, advance_seeds
from engine.graph.spec import SEED_MAX
from engine.telemetry import EventBus, EventRecorder


@pytest.fixture
def recorder():
    return EventRecorder()


@pytest.fixture
def executor(nodes, recorder):
    bus = EventBus()
    bus.subscribe(recorder)
    return Executor(nodes.lookup, bus=bus, settings={"models": "/nowhere"})


def number_chain() -> Workflow:
    """Const(1) -> Scale(x2) -> Scale(x3) -> Sink, plus Const(4) -> Add.b, Scale#2 -> Add.a -> Sink."""
    wf = Workflow()
    const, scale_a, scale_b, sink = (wf.add_node(t) for t in ("Const", "Scale", "Scale", "Sink"))
    scale_b.widgets["factor"] = 3
    wf.connect(const.id, 0, scale_a.id, "x", "NUM")
    wf.connect(scale_a.id, 0, scale_b.id, "x", "NUM")
    wf.connect(scale_b.id, 0, sink.id, "value", "NUM")
    four, add, sink_2 = wf.add_node("Const", {"value": 4}), wf.add_node("Add"), wf.add_node("Sink")
    wf.connect(scale_a.id, 0, add.id, "a", "NUM")
    wf.connect(four.id, 0, add.id, "b", "NUM")
    wf.connect(add.id, 0, sink_2.id, "value", "NUM")
    return wf  # ids: 1 Const, 2 Scale, 3 Scale, 4 Sink, 5 Const(4), 6 Add, 7 Sink


def test_first_run_computes_every_output_in_topological_order(nodes, executor):
    result = executor.run(number_chain(), job_id="j1")
    assert result.status == "finished" and result.failure is None and result.errors == []
    assert result.outputs == {"4": (1 * 2 * 3,), "7": (1 * 2 + 4,)}
    assert result.executed == ["1", "2", "3", "4", "5", "6", "7"]
    assert result.seconds >= 0


def test_unchanged_graph_reruns_nothing(nodes, executor, recorder):
    wf = number_chain()
    executor.run(wf)
    nodes.calls.clear()
    result = executor.run(wf)
    assert nodes.calls == {}
    assert result.executed == []
    assert result.outputs == {"4": (6,), "7": (6,)}
    assert [e["node_id"] for e in recorder.of_kind("node_cached")][-2:] == ["4", "7"]


def test_job_started_names_the_nodes_whose_cached_result_matches(nodes, executor, recorder):
    wf = number_chain()
    executor.run(wf)
    wf.nodes["3"].widgets["factor"] = 5
    executor.run(wf)
    first, second = recorder.of_kind("job_started")
    assert first["cached"] == []
    assert second["cached"] == ["1", "2", "5", "6", "7"]  # ComfyUI's execution_cached lists these


def test_changed_widget_reruns_only_that_node_and_its_descendants(nodes, executor):
    wf = number_chain()
    executor.run(wf)
    nodes.calls.clear()
    wf.nodes["3"].widgets["factor"] = 5  # the second Scale, upstream of Sink 4 only
    result = executor.run(wf)
    assert dict(nodes.calls) == {"3": 1, "4": 1}
    assert result.outputs == {"4": (1 * 2 * 5,), "7": (6,)}
    nodes.calls.clear()
    wf.nodes["2"].widgets["factor"] = 10  # the first Scale feeds both branches
    result = executor.run(wf)
    assert dict(nodes.calls) == {"2": 1, "3": 1, "4": 1, "6": 1, "7": 1}
    assert result.outputs == {"4": (1 * 10 * 5,), "7": (10 + 4,)}


def test_an_explicit_default_value_keeps_the_cache(nodes, executor):
    wf = number_chain()
    executor.run(wf)
    nodes.calls.clear()
    wf.nodes["2"].widgets["factor"] = 2  # was missing, i.e. the default 2
    executor.run(wf)
    assert nodes.calls == {}


def test_only_ancestors_of_output_nodes_run(nodes, executor):
    wf = number_chain()
    stray = wf.add_node("Scale")
    wf.connect("1", 0, stray.id, "x", "NUM")
    result = executor.run(wf)
    assert stray.id not in nodes.calls and stray.id not in result.executed


def test_clear_cache_and_removed_nodes_leave_the_cache(nodes, executor):
    wf = number_chain()
    executor.run(wf)
    assert executor.cached_node_ids() == ["1", "2", "3", "4", "5", "6", "7"]
    wf.remove_node("7")
    executor.run(wf)
    assert executor.cached_node_ids() == ["1", "2", "3", "4", "5", "6"]
    executor.clear_cache()
    nodes.calls.clear()
    executor.run(wf)
    assert sorted(nodes.calls) == ["1", "2", "3", "4"]  # 5 and 6 feed no output node any more


def test_muted_nodes_do_not_run_and_their_branch_is_left_out(nodes, executor):
    wf = number_chain()
    wf.nodes["7"].mode = "muted"
    result = executor.run(wf)
    assert result.status == "finished"
    assert sorted(nodes.calls) == ["1", "2", "3", "4"]
    assert result.outputs == {"4": (6,)}


def test_muted_node_feeding_a_required_input_makes_the_job_invalid(nodes, executor, recorder):
    wf = number_chain()
    wf.nodes["2"].mode = "muted"
    result = executor.run(wf, job_id="bad")
    assert result.status == "invalid"
    assert [(e.kind, e.node_id) for e in result.errors] == [("missing_input", "3"), ("missing_input", "6")]
    assert nodes.calls == {} and result.executed == []
    assert recorder.kinds() == ["job_started", "job_finished"]
    finished = recorder.of_kind("job_finished")[0]
    assert finished["status"] == "invalid" and "fed only by muted node 2" in finished["errors"][0]


def test_bypassed_node_passes_the_input_of_the_same_type_through(nodes, executor):
    wf = Workflow()
    loader, patch, sampler, show = (wf.add_node(t) for t in ("Loader", "ModelPatch", "Sampler", "Show"))
    wf.connect(loader.id, 0, patch.id, "model", "MODEL")
    wf.connect(patch.id, 0, sampler.id, "model", "MODEL")
    wf.connect(sampler.id, 0, show.id, "anything", "LATENT")
    executor.run(wf)
    assert nodes.calls[patch.id] == 1
    patch.mode = "bypassed"
    nodes.calls.clear()
    wf.connect(patch.id, 1, sampler.id, "seed", "INT")  # the INT output has no INT input to take: None
    seen = []
    unsubscribe = executor.bus.subscribe(lambda e: seen.append(e) if e.kind == "preview" else None)
    result = executor.run(wf)
    unsubscribe()
    assert result.status == "finished", result.failure
    assert patch.id not in nodes.calls and patch.id not in result.executed
    assert sorted(nodes.calls) == [sampler.id, show.id]  # the sampler's model input changed
    assert seen[0]["image"] == "preview of model:tiny.safetensors"  # the loader's model, unpatched


def test_interrupt_from_another_thread_stops_the_job_and_the_executor_stays_usable(nodes, executor, recorder):
    wf = number_chain()
    looper = wf.add_node("Looper")
    sink = wf.add_node("Sink")
    wf.connect("1", 0, looper.id, "x", "NUM")
    wf.connect(looper.id, 0, sink.id, "value", "NUM")

    def interrupt_when_looping():
        assert nodes.looper_started.wait(10)
        executor.interrupt()

    thread = threading.Thread(target=interrupt_when_looping)
    thread.start()
    result = executor.run(wf, job_id="j")
    thread.join()
    assert result.status == "interrupted"
    assert recorder.of_kind("job_interrupted")[0].fields == {"job_id": "j", "node_id": looper.id}
    assert recorder.kinds()[-1] == "job_finished"
    assert recorder.of_kind("job_finished")[0]["status"] == "interrupted"
    assert sink.id not in nodes.calls

    wf.remove_node(looper.id)
    wf.remove_node(sink.id)
    nodes.calls.clear()
    result = executor.run(wf)  # the flag was cleared; what finished before the interrupt is cached
    assert result.status == "finished"
    assert "1" not in nodes.calls


def test_interrupt_before_the_next_node_stops_between_nodes(nodes, executor):
    wf = number_chain()
    executor.run(wf)
    executor.interrupt()  # a stale interrupt of an idle executor does not stop the next job
    assert executor.run(wf).status == "finished"


def test_node_failure_fails_the_job_publishes_an_event_and_keeps_the_cache(nodes, executor, recorder):
    wf = number_chain()
    boom = wf.add_node("Boom", {"fuse": 1})
    sink = wf.add_node("Sink")
    wf.connect("3", 0, boom.id, "x", "NUM")
    wf.connect(boom.id, 0, sink.id, "value", "NUM")
    result = executor.run(wf, job_id="f")
    assert result.status == "failed"
    failure = result.failure
    assert (failure.node_id, failure.node_type, failure.exception_type) == (boom.id, "Boom", "RuntimeError")
    assert failure.message == "boom at 6"
    assert "RuntimeError: boom at 6" in failure.traceback and "conftest.py" in failure.traceback
    (event,) = recorder.of_kind("node_failed")
    assert event.fields == {"job_id": "f", "node_id": boom.id, "node_type": "Boom",
                            "exception_type": "RuntimeError", "message": "boom at 6",
                            "traceback": failure.traceback}
    assert recorder.kinds()[-2:] == ["node_failed", "job_finished"]

    boom.widgets["fuse"] = 0
    nodes.calls.clear()
    result = executor.run(wf)
    assert result.status == "finished"
    assert result.outputs[sink.id] == (6,)
    assert sorted(nodes.calls) == [boom.id, sink.id]  # everything that finished before the failure was cached


def test_wrong_number_of_outputs_is_a_node_failure(nodes, executor):
    class Bad(nodes.Sink):
        type_name = "Bad"

        def run(self, ctx, value):
            return (1, 2)

    wf = Workflow()
    const, bad = wf.add_node("Const"), wf.add_node("Bad")
    wf.connect(const.id, 0, bad.id, "value", "NUM")
    result = Executor(lambda name: Bad if name == "Bad" else nodes.lookup(name), bus=EventBus()).run(wf)
    assert result.status == "failed"
    assert result.failure.message == "run() returned 2 values; expected a tuple of 1 outputs"


def test_events_come_in_order_with_progress_and_preview(nodes, executor, recorder):
    wf = Workflow()
    loader, sampler, show = (wf.add_node(t) for t in ("Loader", "Sampler", "Show"))
    sampler.widgets["steps"] = 2
    wf.connect(loader.id, 0, sampler.id, "model", "MODEL")
    wf.connect(sampler.id, 0, show.id, "anything", "LATENT")
    executor.run(wf, job_id="e")
    assert recorder.kinds() == [
        "job_started",
        "node_started", "node_finished",
        "node_started", "progress", "progress", "preview", "node_finished",
        "node_started", "node_finished",
        "job_finished",
    ]
    events = recorder.events
    assert all(e["job_id"] == "e" for e in events)
    assert events[0]["node_count"] == 3
    assert [(e["node_id"], e["node_type"]) for e in recorder.of_kind("node_started")] == [
        ("1", "Loader"), ("2", "Sampler"), ("3", "Show")]
    assert [(e["value"], e["max"]) for e in recorder.of_kind("progress")] == [(1, 2), (2, 2)]
    assert events[-1]["status"] == "finished" and events[-1]["seconds"] >= 0
    executor.run(wf, job_id="e2")
    # Only the output node is needed now, and it is cached.
    assert recorder.kinds()[11:] == ["job_started", "node_cached", "job_finished"]


def test_run_context_carries_node_id_settings_and_workflow(nodes, executor):
    seen = {}

    class Probe(nodes.Show):
        type_name = "Probe"

        def run(self, ctx, anything):
            seen.update(node_id=ctx.node_id, settings=ctx.settings, workflow=ctx.workflow)
            return ()

    wf = Workflow()
    const, probe = wf.add_node("Const"), wf.add_node("Probe")
    wf.connect(const.id, 0, probe.id, "anything", "NUM")
    executor.lookup = lambda name: Probe if name == "Probe" else nodes.lookup(name)
    executor.run(wf)
    assert seen == {"node_id": probe.id, "settings": {"models": "/nowhere"}, "workflow": wf}


def test_advance_seeds_applies_control_after_generate_to_the_document(nodes):
    wf = Workflow()
    for control, seed in [("fixed", 7), ("increment", SEED_MAX), ("decrement", 0), ("randomize", 7)]:
        node = wf.add_node("Sampler", {"seed": seed})
        node.seed_controls["seed"] = control
    missing = wf.add_node("Sampler")
    missing.seed_controls["seed"] = "increment"  # no value stored: starts from the type's default 5
    linked = wf.add_node("Sampler", {"seed": 1})
    linked.seed_controls["seed"] = "increment"
    patch = wf.add_node("ModelPatch")
    wf.connect(patch.id, 1, linked.id, "seed", "INT")
    expected_random = random.Random(3).randint(0, SEED_MAX)

    changed = advance_seeds(wf, nodes.lookup, rng=random.Random(3))
    seeds = [wf.nodes[str(i)].widgets.get("seed") for i in range(1, 7)]
    assert seeds == [7, 0, SEED_MAX, expected_random, 6, 1]
    assert changed == {"2": {"seed": 0}, "3": {"seed": SEED_MAX}, "4": {"seed": expected_random},
                       "5": {"seed": 6}}


def test_seed_changes_make_the_next_queue_rerun_the_sampler(nodes, executor):
    wf = Workflow()
    loader, sampler, show = (wf.add_node(t) for t in ("Loader", "Sampler", "Show"))
    sampler.widgets.update(seed=41, steps=1)
    sampler.seed_controls["seed"] = "increment"
    wf.connect(loader.id, 0, sampler.id, "model", "MODEL")
    wf.connect(sampler.id, 0, show.id, "anything", "LATENT")
    executor.run(wf)
    assert sampler.widgets["seed"] == 41  # run() itself leaves the document alone
    advance_seeds(wf, nodes.lookup)
    nodes.calls.clear()
    executor.run(wf)
    assert sampler.widgets["seed"] == 42 and sorted(nodes.calls) == [sampler.id, show.id]


def test_a_changed_fingerprint_reruns_the_node_though_its_widgets_are_unchanged(nodes):
    from engine.graph.spec import NodeType, Output, RunContext, string_input

    state = {"version": 1}

    class ReadsFile(NodeType):
        inputs = (string_input("path", "a.txt"),)
        outputs = (Output("value", "NUM"),)

        @classmethod
        def fingerprint(cls, settings, **widgets):
            return state["version"]

        def run(self, ctx: RunContext, path: str) -> tuple:
            nodes.calls[ctx.node_id] += 1
            return (state["version"],)

    lookup = {"ReadsFile": ReadsFile, "Sink": nodes.lookup("Sink")}.get
    wf = Workflow()
    reader, sink = wf.add_node("ReadsFile"), wf.add_node("Sink")
    wf.connect(reader.id, 0, sink.id, "value", "NUM")
    executor = Executor(lookup, bus=EventBus())
    executor.run(wf)
    assert executor.run(wf).executed == []
    state["version"] = 2
    result = executor.run(wf)
    assert result.executed == [reader.id, sink.id] and result.outputs[sink.id] == (2,)


def test_changed_memory_settings_rerun_model_loaders_but_not_other_nodes(nodes):
    from engine.graph.spec import NodeType, Output, RunContext, string_input

    class Loader(NodeType):
        memory_module = "diffusion"
        inputs = (string_input("name", "model.safetensors"),)
        outputs = (Output("value", "NUM"),)

        def run(self, ctx: RunContext, name: str) -> tuple:
            nodes.calls[ctx.node_id] += 1
            return (1,)

    lookup = {"Loader": Loader, "Const": nodes.lookup("Const"), "Sink": nodes.lookup("Sink")}.get
    wf = Workflow()
    loader, const = wf.add_node("Loader"), wf.add_node("Const")
    for source in (loader, const):
        wf.connect(source.id, 0, wf.add_node("Sink").id, "value", "NUM")
    executor = Executor(lookup, bus=EventBus())
    executor.run(wf)
    wf.settings["memory"] = {"params_backend": "disk"}
    result = executor.run(wf)
    assert loader.id in result.executed and const.id not in result.executed
