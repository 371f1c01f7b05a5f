"""The download path of `hyperqwen prepare`, for real: huggingface_hub offline (HF_HUB_OFFLINE=1)
or pointed at a closed local port (HF_ENDPOINT) refuses with how to place the files by hand, and
files placed by hand after that are prepared."""

from __future__ import annotations

import re
import shutil

import pytest
from local_server import free_port
from test_prepare_common import prepare_process, tiny_base_dir

from hyperqwen.prepare.download import DEFAULT_BASE_REPO
from hyperqwen.prepare.marker import PREPARED_MARKER


@pytest.mark.parametrize("network", ["offline", "unreachable"])
def test_a_failed_download_says_where_to_put_which_files(network, tmp_path):
    model = tmp_path / "models" / "base"
    env = {"HF_HOME": str(tmp_path / "hf")}
    if network == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    done = prepare_process(str(model), "--repo", "someone/some-base", env=env)
    assert done.returncode == 2, done.stderr
    assert "downloading someone/some-base" in done.stdout
    message = done.stderr
    assert f"could not download someone/some-base into {model}" in message
    assert re.search(
        r"put the base checkpoint's files \(config\.json, model\.safetensors\.index\.json, every "
        r"model-\*\.safetensors shard, tokenizer\.json, tokenizer_config\.json, "
        rf"chat_template\.jinja\) into {re.escape(str(model))}",
        message,
    )
    assert "hf download someone/some-base --local-dir DIR" in message
    assert not (model / "config.json").exists()


def test_files_placed_by_hand_after_a_failed_download_are_prepared(tmp_path, tmp_path_factory):
    """The download stays marked unfinished: a run with network later would complete it."""
    model = tmp_path / "base"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    assert prepare_process(str(model), env=env).returncode == 2
    for path in tiny_base_dir(tmp_path_factory).iterdir():
        shutil.copy(path, model / path.name)
    done = prepare_process(str(model), "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert f"could not reach the hub for {DEFAULT_BASE_REPO}; using the files in {model}" in (
        done.stderr
    )
    assert (model / PREPARED_MARKER).is_file()
    assert '"complete": false' in (model / ".hyperqwen" / "download.json").read_text()


def test_no_download_refuses_without_touching_the_disk(tmp_path):
    model = tmp_path / "absent"
    done = prepare_process(str(model), "--no-download")
    assert done.returncode == 2
    assert "has no config.json and --no-download was given" in done.stderr
    assert not model.exists()
