"""`hyperqwen doctor`: is this machine ready to serve? One line per check, each with its fix."""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from hyperqwen.capacity_probe import probe_machine
from hyperqwen.engine.features import FEATURES, OFF, ON
from hyperqwen.gpu import MIN_COMPUTE_CAPABILITY, MIN_MEMORY_GIB_27B, REQUIREMENT, NoGpu, list_gpus
from hyperqwen.launch import build_launch, choose_host, model_path, start_refusal
from hyperqwen.prepare.marker import PREPARED_MARKER
from hyperqwen.settings import (
    MODES,
    PINNED_VLLM,
    LoadedSettings,
    SettingsError,
    load_settings,
    resolve_api_key,
)
from hyperqwen.toolkit import choose_toolkit, missing_headers
from hyperqwen.vllm_plugin import ENTRY_POINT, entry_point_installed

Status = Literal["OK", "WARN", "FAIL"]
PINNED_TORCH = "2.11.0"
SUPPORTED_PYTHONS = ((3, 11), (3, 12))
# The W4A16 base is ~20 GB; prepare keeps a pristine copy of the tensors it rewrites.
FREE_DISK_FOR_MODEL_GIB = 45


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name:<10} {self.detail}"
        return text + (f"\n{'':16}fix: {self.fix}" if self.fix else "")


def check_python(version: tuple[int, int] = sys.version_info[:2]) -> Check:
    shown = f"{version[0]}.{version[1]}"
    if version in SUPPORTED_PYTHONS:
        return Check("OK", "python", f"{shown} ({sys.executable})")
    return Check(
        "FAIL",
        "python",
        f"{shown} is not supported",
        "use Python 3.11 or 3.12: bash install.sh creates a venv with it",
    )


def check_package(name: str, pinned: str) -> Check:
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return Check(
            "FAIL",
            name,
            "not installed",
            f"bash install.sh (or pip install '.[serve]') installs {name}=={pinned}",
        )
    if installed.split("+")[0] != pinned:
        return Check(
            "FAIL",
            name,
            f"{installed} installed, pinned {pinned}",
            f"pip install {name}=={pinned} (the patch series targets exactly it)",
        )
    return Check("OK", name, f"{installed} (pinned {pinned})")


def check_patches() -> Check:
    from hyperqwen.patches.tree import series_status

    try:
        applied, detail = series_status()
    except Exception as error:  # the doctor reports, it does not crash
        return Check(
            "FAIL",
            "patches",
            f"cannot check: {error}",
            "bash install.sh installs vLLM and applies the series",
        )
    if applied:
        return Check("OK", "patches", detail)
    return Check("FAIL", "patches", detail, "hyperqwen patches apply")


def check_plugin(installed: Callable[[], bool] = entry_point_installed) -> Check:
    """Whether vLLM will load HyperQwen's plugin: it finds it only through the installed
    package's entry point, which a source folder on PYTHONPATH does not have."""
    if installed():
        return Check("OK", "plugin", f"vLLM loads {ENTRY_POINT} (the package's entry point)")
    needing = ", ".join(f.turned_on_by or f.knob for f in FEATURES if f.registers)
    return Check(
        "WARN",
        "plugin",
        f"no vllm.general_plugins entry point names {ENTRY_POINT} (hyperqwen imported from a "
        f"source folder?): vLLM will not load the plugin, and serve refuses {needing}",
        "bash install.sh, or pip install -e . in the checkout",
    )


def check_gpu(lister: Callable[[], list] = list_gpus) -> list[Check]:
    try:
        gpus = lister()
    except NoGpu as reason:
        return [Check("FAIL", "gpu", f"no CUDA GPU ({reason})", f"serving needs {REQUIREMENT}")]
    checks = []
    for gpu in gpus:
        detail = f"#{gpu.index} {gpu.name}, {gpu.sm}, {gpu.memory_gib:.1f} GiB, driver {gpu.driver}"
        if gpu.compute_capability < MIN_COMPUTE_CAPABILITY:
            checks.append(
                Check("FAIL", "gpu", detail, "compute capability 8.0+ is needed (Ampere or newer)")
            )
        elif gpu.memory_gib < MIN_MEMORY_GIB_27B - 1:
            checks.append(
                Check(
                    "WARN",
                    "gpu",
                    detail,
                    f"the 27B model needs {MIN_MEMORY_GIB_27B} "
                    "GB; smaller models or GPU_COUNT>1 may fit",
                )
            )
        else:
            checks.append(Check("OK", "gpu", detail))
    return checks


def check_model(loaded: LoadedSettings) -> list[Check]:
    path = model_path(loaded.settings)
    models_dir = loaded.settings.MODELS_DIR
    checks = []
    if not (path / "config.json").is_file():
        checks.append(
            Check(
                "FAIL",
                "model",
                f"{path}: no config.json",
                "hyperqwen prepare (downloads and prepares it), or set MODEL to a model folder",
            )
        )
    elif (path / PREPARED_MARKER).is_file():
        checks.append(Check("OK", "model", f"{path} (prepared)"))
    else:
        checks.append(
            Check(
                "WARN",
                "model",
                f"{path} present but not prepared by hyperqwen",
                "hyperqwen prepare (serving an unprepared base works, slower)",
            )
        )
    existing = next(p for p in (path, models_dir, *models_dir.absolute().parents) if p.exists())
    free_gib = shutil.disk_usage(existing).free / 2**30
    needed = 5 if checks[0].status != "FAIL" else FREE_DISK_FOR_MODEL_GIB
    status: Status = "OK" if free_gib >= needed else "WARN"
    checks.append(
        Check(
            status,
            "disk",
            f"{free_gib:.0f} GiB free at {existing}",
            "" if status == "OK" else f"free {needed} GiB (model + caches)",
        )
    )
    return checks


def check_exposure(loaded: LoadedSettings, in_container: bool) -> Check:
    api_key, source = resolve_api_key(loaded.settings)
    host, warnings, _ = choose_host(loaded.settings, api_key, in_container, loaded.explicit)
    key = f"key set ({source})" if api_key else "no key"
    where = f"publish {loaded.settings.BIND}" if in_container else f"bind {host}"
    if warnings:
        return Check("WARN", "access", f"{where}, {key}", warnings[0])
    return Check("OK", "access", f"{where}, {key}")


def check_toolkit(environ: dict[str, str]) -> Check:
    """The CUDA toolkit JIT-compiled kernels (FlashInfer on Ampere/Ada) will use."""
    choice = choose_toolkit(environ)
    if choice.system and choice.system.explicit and choice.mismatch:
        return Check(
            "WARN",
            "toolkit",
            f"CUDA toolkit for JIT kernels: {choice.mismatch}; kernels compiled at first use may "
            "fail",
            f"unset CUDA_HOME (serve then uses the venv's {choice.venv}), or point it at a "
            "toolkit of torch's CUDA release",
        )
    if why := choice.venv_reason:
        where = f"CUDA toolkit for JIT kernels: the venv's ({choice.venv}; {why})"
        if lacking := missing_headers(choice.venv):
            return Check("WARN", "toolkit", where, lacking)
        return Check("OK", "toolkit", where)
    if choice.system:
        return Check("OK", "toolkit", f"CUDA toolkit for JIT kernels: {choice.system.where}")
    return Check(
        "WARN",
        "toolkit",
        "no CUDA toolkit (nvcc): kernels vLLM compiles at first use (FlashInfer attention for "
        "an fp8 KV cache on Ampere/Ada) will fail",
        "bash install.sh (the venv brings nvcc), or install a CUDA 13 toolkit and set CUDA_HOME",
    )


def check_fit(loaded: LoadedSettings, lister: Callable[[], list] = list_gpus) -> list[Check]:
    """What each mode's profile gets on this machine's card (the launcher's sizing), or the
    refusal `hyperqwen serve` would print: a knob the cards or the model folder cannot take
    (launch.start_refusal), or one the card cannot hold. Nothing without a GPU: the gpu check
    says why, and serve then sizes for an assumed card."""
    try:
        gpus = lister()
    except NoGpu:
        return []
    machine = probe_machine(loaded.settings, model_path(loaded.settings), gpus)
    checks = []
    for mode in MODES:
        refusal = start_refusal(loaded.settings, mode, gpus[: loaded.settings.GPU_COUNT])
        if refusal:  # what `hyperqwen serve MODE` would refuse before vLLM starts
            checks.append(Check("FAIL", "fit", f"{mode}: {refusal}", "set the knob it names"))
            continue
        try:
            plan = build_launch(loaded, mode, api_key=None, machine=machine)
        except SettingsError as refusal:  # a knob the card cannot hold, or a refused combination
            fix = "set the knob it names as it says"
            checks.append(Check("FAIL", "fit", f"{mode}: {refusal}", fix))
            continue
        detail = plan.fit.line or f"not sized to the card: {machine}"
        named = detail if detail.startswith(mode) else f"{mode}, {detail}"
        checks.append(Check("OK", "fit", named))
    return checks


def check_engine_features(loaded: LoadedSettings, environ: dict[str, str]) -> list[Check]:
    """What each engine feature runs with in `hyperqwen serve MODE` for these settings, and any
    of their variables set by hand, which reach vLLM wherever the launcher leaves them unset."""
    checks = []
    for mode in MODES:
        states = []
        for feature in FEATURES:
            if mode in feature.modes:
                state = feature.state(feature.env_for(loaded.settings, mode))
                states.append(f"{feature.name} {({ON: 'on', OFF: 'off'}).get(state, state)}")
        checks.append(Check("OK", "engine", f"{mode}: {', '.join(states)}"))
    for feature in FEATURES:
        if feature.env in environ:
            checks.append(
                Check(
                    "WARN",
                    "engine",
                    f"{feature.env}={environ[feature.env]} is set in this environment: it reaches "
                    f"vLLM wherever {feature.knob} leaves it unset",
                    f"unset {feature.env} and set the {feature.knob} knob instead",
                )
            )
    return checks


def run_doctor(environ: dict[str, str], in_container: bool) -> tuple[list[Check], int]:
    gpus = functools.cache(list_gpus)  # nvidia-smi once for the gpu and fit checks
    checks = [
        check_python(),
        check_package("vllm", PINNED_VLLM),
        check_package("torch", PINNED_TORCH),
        check_patches(),
        check_plugin(),
        *check_gpu(gpus),
        check_toolkit(environ),
    ]
    try:
        loaded = load_settings(environ)
    except SettingsError as error:
        checks.append(Check("FAIL", "settings", str(error)))
    else:
        checks.append(Check("OK", "settings", "all knobs valid"))
        checks += check_engine_features(loaded, environ)
        checks += check_model(loaded)
        checks += check_fit(loaded, gpus)
        checks.append(check_exposure(loaded, in_container))
    failed = any(check.status == "FAIL" for check in checks)
    return checks, 1 if failed else 0
