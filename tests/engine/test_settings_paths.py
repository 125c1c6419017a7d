import json
import os
from pathlib import Path

import pytest

from engine.settings import (
    MODEL_FOLDERS,
    Settings,
    SettingsError,
    cache_dir,
    load_settings,
    resources_dir,
    save_settings,
    with_memory_defaults,
)


def write_settings_file(path: Path, **values: object) -> Path:
    path.write_text(json.dumps(values), encoding="utf-8")
    return path


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(models_root=tmp_path / "models", output_dir=tmp_path / "output", plugins_dir=None,
                    embedded_models=False)


def test_flag_beats_environment_beats_file_beats_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    file = write_settings_file(tmp_path / "s.json", models_root="/file/models", output_dir="/file/out",
                               plugins_dir="/file/plugins")
    env = {"SLUICE_MODELS": "/env/models", "SLUICE_OUTPUT": "/env/out"}
    s = load_settings(models_root="/flag/models", env=env, settings_file=file)
    assert s.models_root == Path("/flag/models")  # flag over env and file
    assert s.output_dir == Path("/env/out")  # env over file
    assert s.plugins_dir == Path("/file/plugins")  # file over default
    default = load_settings(env={}, settings_file=tmp_path / "missing.json")
    assert default.models_root == tmp_path / "models"
    assert default.output_dir == tmp_path / "output"
    assert default.plugins_dir is None


def test_settings_file_is_found_through_sluice_settings_and_relative_paths_follow_it(tmp_path):
    folder = tmp_path / "conf"
    folder.mkdir()
    file = write_settings_file(folder / "settings.json", models_root="m", theme="dark")
    s = load_settings(env={"SLUICE_SETTINGS": str(file)})
    assert s.models_root == folder / "m"
    assert s.extra == {"theme": "dark"}


def test_environment_plugins_folder_and_empty_values_fall_through(tmp_path):
    s = load_settings(env={"SLUICE_PLUGINS": str(tmp_path / "p"), "SLUICE_MODELS": ""},
                      settings_file=tmp_path / "none.json")
    assert s.plugins_dir == tmp_path / "p"
    assert s.models_root == Path.cwd() / "models"


def test_malformed_settings_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(SettingsError, match="bad.json"):
        load_settings(env={}, settings_file=bad)
    wrong = write_settings_file(tmp_path / "wrong.json", models_root=3)
    with pytest.raises(SettingsError, match="models_root must be a path string"):
        load_settings(env={}, settings_file=wrong)


def test_save_then_load_round_trips(tmp_path):
    original = Settings(tmp_path / "m", tmp_path / "o", tmp_path / "p", {"recent": ["a.json"]})
    path = tmp_path / "deep" / "settings.json"
    save_settings(original, path)
    assert load_settings(env={}, settings_file=path) == original
    save_settings(Settings(tmp_path / "m", tmp_path / "o", None), path)
    assert load_settings(env={}, settings_file=path).plugins_dir is None


def test_resources_dir_is_next_to_the_packages():
    assert resources_dir() == Path(__file__).resolve().parents[2] / "resources"


def test_legacy_folder_aliases_unet_and_clip_are_searched(settings):
    touch(settings.models_root / "unet" / "flux.gguf")
    touch(settings.models_root / "diffusion_models" / "sd3.safetensors")
    touch(settings.models_root / "clip" / "t5" / "t5xxl.safetensors")
    assert settings.list_models("diffusion_models") == ["flux.gguf", "sd3.safetensors"]
    assert settings.list_models("text_encoders") == ["t5/t5xxl.safetensors"]
    flux = settings.resolve_model("diffusion_models", "flux.gguf")
    assert flux == settings.models_root / "unet" / "flux.gguf"
    assert [p.name for p in settings.model_dirs("text_encoders")] == ["text_encoders", "clip"]


def test_list_models_is_recursive_sorted_and_filters_extensions(settings):
    root = settings.models_root / "checkpoints"
    for name in ("b.safetensors", "a/z.ckpt", "a/y.CKPT", "notes.txt", ".hidden.safetensors", "c.pth"):
        touch(root / name)
    assert settings.list_models("checkpoints") == ["a/y.CKPT", "a/z.ckpt", "b.safetensors", "c.pth"]
    assert settings.list_models("checkpoints", extensions=(".pth",)) == ["c.pth"]
    assert settings.list_models("loras") == []  # folder does not exist


def test_windows_separators_in_model_names_resolve(settings):
    path = touch(settings.models_root / "loras" / "style" / "ink.safetensors")
    assert settings.resolve_model("loras", "style\\ink.safetensors") == path


def test_missing_model_error_names_the_name_the_folders_and_what_is_there(settings):
    for i in range(12):
        touch(settings.models_root / "vae" / f"vae{i:02d}.safetensors")
    with pytest.raises(SettingsError) as caught:
        settings.resolve_model("vae", "nope.safetensors")
    message = str(caught.value)
    assert "'nope.safetensors'" in message
    assert str(settings.models_root / "vae") in message
    assert "vae00.safetensors" in message and "vae09.safetensors" in message
    assert "vae11.safetensors" not in message and "2 more" in message


@pytest.mark.parametrize("name", ["../secret.safetensors", "a/../../x.ckpt", "/etc/passwd", "C:\\x.ckpt", ""])
def test_model_names_that_escape_the_folders_are_rejected(settings, name):
    touch(settings.models_root / "secret.safetensors")
    with pytest.raises(SettingsError, match="model name"):
        settings.resolve_model("checkpoints", name)


def test_unknown_model_kind_lists_the_kinds(settings):
    with pytest.raises(SettingsError) as caught:
        settings.list_models("unets")
    assert "'unets'" in str(caught.value)
    assert all(kind in str(caught.value) for kind in MODEL_FOLDERS)


def test_output_counter_continues_after_existing_files_and_never_overwrites(settings):
    first = settings.output_path("img", "png")
    assert first == settings.output_dir.resolve() / "img_00001_.png"
    touch(first)
    second = settings.output_path("img", ".png")
    assert second.name == "img_00002_.png"
    touch(settings.output_dir / "img_00007_.png")
    assert settings.output_path("img", "png").name == "img_00008_.png"
    assert settings.output_path("img", "jpg").name == "img_00001_.jpg"
    assert settings.output_path("imgx", "png").name == "imgx_00001_.png"  # other prefixes do not count


def test_output_counter_skips_a_dangling_symlink_of_the_next_name(settings, tmp_path):
    settings.output_dir.mkdir(parents=True)
    os.symlink(tmp_path / "nowhere", settings.output_dir / "img_00001_.png")
    assert settings.output_path("img", "png").name == "img_00002_.png"


def test_output_prefix_with_subfolders_creates_them(settings):
    path = settings.output_path("portraits/2024/img", "png")
    assert path.parent == settings.output_dir.resolve() / "portraits" / "2024"
    assert path.parent.is_dir()


@pytest.mark.parametrize("prefix", ["../img", "a/../../img", "/tmp/img", "portraits/", ""])
def test_output_prefix_outside_the_folder_is_rejected(settings, prefix):
    with pytest.raises(SettingsError, match="output prefix"):
        settings.output_path(prefix, "png")


def test_output_prefix_through_a_symlink_leaving_the_folder_is_rejected(settings, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    settings.output_dir.mkdir(parents=True)
    os.symlink(outside, settings.output_dir / "link")
    with pytest.raises(SettingsError, match="'link/sub/img'"):
        settings.output_path("link/sub/img", "png")
    assert not (outside / "sub").exists()  # nothing was created outside


def test_cache_dir_from_environment_file_xdg_or_home_and_off(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")
    missing = tmp_path / "absent.json"
    assert cache_dir(env={}, settings_file=missing) == tmp_path / "home" / ".cache" / "sluice"
    assert cache_dir(env={"XDG_CACHE_HOME": "/xdg"}, settings_file=missing) == Path("/xdg/sluice")
    file = write_settings_file(tmp_path / "s.json", cache_dir="cache")
    assert cache_dir(env={"XDG_CACHE_HOME": "/xdg"}, settings_file=file) == tmp_path / "cache"  # by the file
    assert cache_dir(env={"SLUICE_CACHE": "/env/cache"}, settings_file=file) == Path("/env/cache")
    assert cache_dir(env={"SLUICE_CACHE": "off"}, settings_file=file) is None
    assert cache_dir(env={}, settings_file=write_settings_file(tmp_path / "n.json", cache_dir=None)) is None
    with pytest.raises(SettingsError, match="cache_dir must be a path string, 'off' or null, got 3"):
        cache_dir(env={}, settings_file=write_settings_file(tmp_path / "b.json", cache_dir=3))


def test_default_memory_settings_round_trip_and_sit_below_the_workflows(tmp_path):
    file = write_settings_file(tmp_path / "settings.json", memory={"max_vram": "6", "params_backend": "cpu"})
    settings = load_settings(env={}, settings_file=file)
    assert settings.memory_defaults() == {"max_vram": "6", "params_backend": "cpu"}
    assert with_memory_defaults({"max_vram": "2"}, settings) == {"max_vram": "2", "params_backend": "cpu"}
    assert with_memory_defaults(None, settings) == {"max_vram": "6", "params_backend": "cpu"}
    assert with_memory_defaults({"backend": "cpu"}, None) == {"backend": "cpu"}
    save_settings(settings, tmp_path / "again.json")
    assert load_settings(env={}, settings_file=tmp_path / "again.json").memory_defaults() == \
        settings.memory_defaults()
    write_settings_file(file, memory=["max_vram", "6"])
    with pytest.raises(SettingsError, match="memory must be an object of memory settings"):
        load_settings(env={}, settings_file=file)
