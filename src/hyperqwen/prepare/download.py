"""Fetch the base checkpoint with `huggingface_hub.snapshot_download` when the folder lacks it.

The download goes straight into the model folder (`local_dir`) and is resumable: files already
complete are skipped, partial ones continue. `.hyperqwen/download.json` says whether the last
download finished, so an interrupted one is resumed on the next run. Offline (HF_HUB_OFFLINE=1),
an unreachable endpoint or a refused repo give one message saying how to place the files by
hand.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from hyperqwen.prepare import folder
from hyperqwen.prepare.folder import CONFIG_NAME, PLACE_BY_HAND

# Not confirmed: no network to the model hub was available when this was written. It is the
# name the W4A16 compressed-tensors base of Qwen3.8-27B is expected to have; pass --repo (or
# place the files by hand) when the public repository is named otherwise.
DEFAULT_BASE_REPO = "Qwen/Qwen3.8-27B-W4A16"
STATE_FILE = f"{folder.WORK_DIR}/download.json"


def _state(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def needs_download(model_dir: Path) -> bool:
    """The folder has no config.json yet, or a download of ours into it did not finish."""
    if not (model_dir / CONFIG_NAME).is_file():
        return True
    return _state(model_dir).get("complete") is False


class _Warnings(logging.Handler):
    """Keeps huggingface_hub's warnings: offline, it warns and returns instead of raising."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def download(repo: str, revision: str | None, model_dir: Path) -> None:
    """Download (or resume) `repo` into `model_dir`; Refused with the by-hand recipe on failure.

    When the hub cannot be reached huggingface_hub warns and returns the folder as it is: with a
    config.json there (files placed by hand, or an earlier download) prepare goes on with them,
    and the download stays marked unfinished, so a later run with network completes it."""
    from huggingface_hub import snapshot_download

    model_dir.mkdir(parents=True, exist_ok=True)
    warnings = _Warnings()
    hub_logger = logging.getLogger("huggingface_hub")
    with folder.exclusive_lock(model_dir):
        state = {"repo": repo, "revision": revision}
        folder.write_text(
            model_dir / STATE_FILE, json.dumps({**state, "complete": False}) + "\n", "download"
        )
        hub_logger.addHandler(warnings)
        try:
            snapshot_download(repo_id=repo, revision=revision, local_dir=model_dir)
        except Exception as error:  # 401/404 on an empty folder, a full disk, ...
            raise _refusal(repo, model_dir, f"{type(error).__name__}: {error}") from None
        finally:
            hub_logger.removeHandler(warnings)
        unreachable = [message for message in warnings.messages if "cannot be accessed" in message]
        if unreachable and not (model_dir / CONFIG_NAME).is_file():
            raise _refusal(repo, model_dir, unreachable[-1])
        if unreachable:
            print(
                f"warning: could not reach the hub for {repo}; using the files in {model_dir}",
                file=sys.stderr,
            )
            return
        folder.write_text(
            model_dir / STATE_FILE, json.dumps({**state, "complete": True}) + "\n", "downloaded"
        )


def _refusal(repo: str, model_dir: Path, reason: str) -> folder.Refused:
    first_line = (reason.strip().splitlines() or [""])[0]
    return folder.Refused(
        f"could not download {repo} into {model_dir}: {first_line}\n"
        "Without network (or with the files elsewhere), "
        + PLACE_BY_HAND.format(folder=model_dir)
        + f" and run `hyperqwen prepare` again; on a machine with access, "
        f"`hf download {repo} --local-dir DIR` fetches them. A repository with another name: "
        "--repo OWNER/NAME."
    )
