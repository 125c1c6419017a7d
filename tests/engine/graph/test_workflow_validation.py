from engine.graph.document import Link, Workflow
from engine.graph.errors import ValidationError
from engine.graph.validate import build_graph, validate


def kinds(errors):
    return sorted(e.kind for e in errors)


def chain(nodes) -> Workflow:
    """Loader -> Sampler -> Show, valid."""
    wf = Workflow()
    loader, sampler, show = wf.add_node("Loader"), wf.add_node("Sampler"), wf.add_node("Show")
    wf.connect(loader.id, 0, sampler.id, "model", "MODEL")
    wf.connect(sampler.id, 0, show.id, "anything", "LATENT")
    return wf


def test_valid_graph_has_no_errors_and_missing_widgets_fall_back_to_defaults(nodes):
    wf = chain(nodes)
    assert wf.nodes["2"].widgets == {}
    assert validate(wf, nodes.lookup) == []


def test_unknown_type_names_the_type(nodes):
    wf = chain(nodes)
    wf.add_node("KSamplerr")
    (error,) = validate(wf, nodes.lookup)
    assert (error.kind, error.node_id) == ("unknown_type", "4")
    assert "'KSamplerr'" in error.message


def test_missing_required_link_input_is_reported_but_optional_is_not(nodes):
    wf = chain(nodes)
    const, add = wf.add_node("Const"), wf.add_node("Add")
    sink = wf.add_node("Sink")
    wf.connect(add.id, 0, sink.id, "value", "NUM")
    errors = validate(wf, nodes.lookup)
    assert [(e.kind, e.node_id, e.input_name) for e in errors] == [("missing_input", add.id, "a")]
    wf.connect(const.id, 0, add.id, "a", "NUM")
    assert validate(wf, nodes.lookup) == []  # "b" is optional


def test_type_mismatch_names_both_types(nodes):
    wf = chain(nodes)
    patch = wf.add_node("ModelPatch")
    wf.connect("1", 1, patch.id, "model", "CLIP")  # Loader output 1 is CLIP
    errors = validate(wf, nodes.lookup)
    (error,) = [e for e in errors if e.kind == "type_mismatch"]
    assert (error.node_id, error.input_name) == (patch.id, "model")
    assert "carries CLIP" in error.message and "takes MODEL" in error.message


def test_any_matches_every_type_and_int_may_feed_a_seed_widget(nodes):
    wf = chain(nodes)
    patch = wf.add_node("ModelPatch")
    wf.connect("1", 0, patch.id, "model", "MODEL")
    wf.connect(patch.id, 1, "2", "seed", "INT")  # INT output into the SEED widget
    assert validate(wf, nodes.lookup) == []
    wf.connect("1", 0, "2", "seed", "MODEL")  # MODEL into the seed: mismatch against INT
    (error,) = validate(wf, nodes.lookup)
    assert (error.kind, error.input_name) == ("type_mismatch", "seed")
    assert "takes INT" in error.message


def test_link_to_missing_input_or_output_index_is_a_bad_link(nodes):
    wf = chain(nodes)
    wf.links.append(Link("8", "1", 0, "2", "modle", "MODEL"))
    wf.links.append(Link("9", "1", 5, "3", "anything", "MODEL"))
    wf.links.append(Link("10", "1", 0, "77", "model", "MODEL"))
    errors = validate(wf, nodes.lookup)
    assert kinds(errors) == ["bad_link"] * 4
    messages = " | ".join(e.message for e in errors)
    assert "input 'modle', which Sampler does not have; inputs: model, seed, steps" in messages
    assert "from output 5 of node 1 (Loader), which has 2 outputs" in messages
    assert "link 10 points at missing node 77" in messages
    assert "second link into the same input" in messages  # link 9 also doubles the link into Show


def test_widget_values_out_of_range_not_a_choice_or_wrong_kind_are_bad_values(nodes):
    wf = chain(nodes)
    wf.nodes["2"].widgets.update(steps=0, sampler="eulr", denoise_all="yes", seed=-1)
    wf.nodes["2"].seed_controls["seed"] = "shuffle"
    wf.nodes["1"].widgets["name"] = 3
    errors = validate(wf, nodes.lookup)
    found = {(e.node_id, e.input_name): e for e in errors if "control" not in e.message}
    assert kinds(errors) == ["bad_value"] * 6
    assert str(found["2", "steps"]) == "node 2 (Sampler) input 'steps': 0 is below the minimum 1"
    assert "'eulr' is not one of the choices (euler, heun)" in found["2", "sampler"].message
    assert "expected true or false, got 'yes'" in found["2", "denoise_all"].message
    assert "-1 is below the minimum 0" in found["2", "seed"].message
    assert "expected a string, got 3" in found["1", "name"].message
    assert [e.message for e in errors if "control" in e.message] == [
        "unknown control after generate 'shuffle'; accepted: fixed, increment, decrement, randomize"]


def test_cycle_lists_the_nodes_on_it(nodes):
    wf = chain(nodes)
    a, b, c = wf.add_node("Add"), wf.add_node("Add"), wf.add_node("Scale")
    wf.connect(a.id, 0, b.id, "a", "NUM")
    wf.connect(b.id, 0, c.id, "x", "NUM")
    wf.connect(c.id, 0, a.id, "a", "NUM")
    (error,) = validate(wf, nodes.lookup)
    assert error.kind == "cycle"
    assert error.message == "the graph has a cycle through nodes 4 -> 5 -> 6 -> 4"


def test_no_output_node_when_the_only_one_is_muted(nodes):
    wf = chain(nodes)
    wf.nodes["3"].mode = "muted"
    errors = validate(wf, nodes.lookup)
    assert kinds(errors) == ["no_output"]
    assert ValidationError("no_output", "x").node_id is None


def test_required_input_fed_only_by_a_muted_node_is_missing_and_muted_nodes_are_not_checked(nodes):
    wf = chain(nodes)
    wf.nodes["1"].mode = "muted"
    wf.nodes["1"].widgets["name"] = 3  # a bad value, but the node is muted
    (error,) = validate(wf, nodes.lookup)
    assert (error.kind, error.node_id, error.input_name) == ("missing_input", "2", "model")
    assert "fed only by muted node 1" in error.message
    graph = build_graph(wf)
    assert sorted(graph) == ["2", "3"] and graph.has_edge("2", "3") and graph.ancestors("3") == {"2"}


def test_all_problems_are_reported_in_one_pass(nodes):
    wf = Workflow()
    wf.add_node("Nope")
    sampler = wf.add_node("Sampler", {"steps": 999})
    a, b = wf.add_node("Add"), wf.add_node("Add")
    wf.connect(a.id, 0, b.id, "a", "NUM")
    wf.connect(b.id, 0, a.id, "a", "NUM")
    wf.connect(a.id, 0, sampler.id, "model", "NUM")
    wf.links.append(Link("99", a.id, 3, b.id, "b", "NUM"))
    wf.add_node("Scale")
    errors = validate(wf, nodes.lookup)
    assert kinds(errors) == ["bad_link", "bad_value", "cycle", "missing_input", "no_output", "type_mismatch",
                             "unknown_type"]
    assert "999 is above the maximum 150" in str(errors)


def test_validation_error_string_without_a_node_is_the_message():
    assert str(ValidationError("no_output", "no output node")) == "no output node"
    assert str(ValidationError("cycle", "loop", "4")) == "node 4: loop"
