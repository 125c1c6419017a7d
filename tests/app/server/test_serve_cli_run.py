"""`sluice run WORKFLOW --server URL` (issue 21 point 3): the workflow runs on a running server whose models
stay loaded, and the images land where `sluice run` writes them."""

from serve_client import request

from app.cli import main
from engine.graph.document import Workflow
from engine.settings import resources_dir

DEFAULT = str(resources_dir() / "workflows" / "default.json")


def last_history_entry(url):
    return list(request("GET", f"{url}/history").json().values())[-1]


def test_run_on_a_server_writes_the_image_locally_and_hits_warm_models(start_server, serve_settings, tmp_path,
                                                                       capsys):
    url, _ = start_server()
    local = tmp_path / "local-output"
    assert main(["--output", str(local), "run", DEFAULT, "--server", url, "--set", "6.steps=2"]) == 0
    captured = capsys.readouterr()
    (printed,) = captured.out.split()
    assert printed == str(local / "sluice_00001_.png")
    assert (local / "sluice_00001_.png").read_bytes() == \
        (serve_settings.output_dir / "sluice_00001_.png").read_bytes()
    assert "[6] KSampler" in captured.err and "step 2/2" in captured.err and "job finished" in captured.err

    assert main(["--output", str(local), "run", DEFAULT, "--server", url, "--quiet", "--set", "6.steps=2",
                 "--set", "6.seed=7"]) == 0
    messages = dict(last_history_entry(url)["status"]["messages"])
    assert messages["execution_cached"]["nodes"] == ["1", "2", "3", "4", "5"]  # the loaders' models stayed
    assert capsys.readouterr().out.split() == [str(local / "sluice_00002_.png")]


def test_run_on_a_server_sharing_the_output_folder_prints_the_servers_file(start_server, serve_settings,
                                                                           capsys):
    url, _ = start_server()
    assert main(["--output", str(serve_settings.output_dir), "run", DEFAULT, "--server", url, "--quiet",
                 "--set", "6.steps=1"]) == 0
    assert capsys.readouterr().out.split() == [str(serve_settings.output_dir / "sluice_00001_.png")]
    assert [path.name for path in serve_settings.output_dir.iterdir()] == ["sluice_00001_.png"]


def test_run_on_a_server_reports_invalid_workflows_and_failed_nodes(start_server, serve_settings, tmp_path,
                                                                    capsys):
    url, _ = start_server()
    assert main(["--output", str(tmp_path), "run", DEFAULT, "--server", url, "--set", "6.seed=-1"]) == 1
    error = capsys.readouterr().err
    assert "sluice: invalid: node 6 (KSampler): Value -1 smaller than min of 0: seed" in error

    input_folder = serve_settings.output_dir.parent / "input"
    input_folder.mkdir(parents=True)
    (input_folder / "broken.png").write_bytes(b"not a png")
    workflow = Workflow()
    load = workflow.add_node("LoadImage", {"image": "broken.png"})
    save = workflow.add_node("SaveImage", {"filename_prefix": "never"})
    workflow.connect(load.id, 0, save.id, "images", "IMAGE")
    workflow.save(tmp_path / "broken.json")
    assert main(["--output", str(tmp_path), "run", str(tmp_path / "broken.json"), "--server", url]) == 1
    assert f"sluice: node {load.id} (LoadImage) failed: " in capsys.readouterr().err


def test_run_on_a_server_needs_a_reachable_server_and_its_token(start_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_AUTH_TOKEN", raising=False)
    assert main(["run", DEFAULT, "--server", "http://127.0.0.1:1"]) == 2
    assert "cannot reach the Sluice server at http://127.0.0.1:1" in capsys.readouterr().err
    url, _ = start_server(auth_token="s3cret")
    assert main(["--output", str(tmp_path), "run", DEFAULT, "--server", url, "--quiet"]) == 2
    assert "needs its auth token" in capsys.readouterr().err
    assert main(["--output", str(tmp_path), "run", DEFAULT, "--server", url.removeprefix("http://"),
                 "--quiet", "--auth-token", "s3cret", "--set", "6.steps=1"]) == 0
