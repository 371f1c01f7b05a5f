"""HyperQwen's vLLM general plugin (pyproject.toml: the `vllm.general_plugins` entry point).

vLLM calls `register` in each of its processes (API server, engine core, workers) before it
builds the model, whenever the hyperqwen package is installed beside it and `VLLM_PLUGINS` does
not leave it out. That includes the stock side of `hyperqwen bench ab`, which runs in the same
environment: so unless the process's environment holds a variable of HyperQwen's
(`ENV_PREFIX`, which every engine feature's variable carries: the launcher sets them), it
returns at once, imports nothing and changes nothing. Otherwise it refuses a value an engine
feature does not take, by name, before the model loads (features.check_environment), instead
of at the first layer or step that reads it.

Engine parts that vLLM has a registry for (an attention backend, a quantization config) are
registered here, after that check, rather than patched in: each feature whose declaration says
it `registers`, while it is switched on (KV=kvarn's attention backend under vLLM's CUSTOM slot).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_PREFIX = "HYPERQWEN_"
ENTRY_POINT = "hyperqwen.vllm_plugin:register"


def register() -> None:
    if not any(name.startswith(ENV_PREFIX) for name in os.environ):
        return
    from hyperqwen.engine.features import FEATURES, check_environment, switched_on

    check_environment()
    for feature in FEATURES:
        if feature.registers and switched_on(feature):
            feature.code().register()


def entry_point_installed() -> bool:
    """Whether vLLM's plugin loader will find `register` (the installed package's entry point)."""
    from importlib.metadata import entry_points

    return any(point.value == ENTRY_POINT for point in entry_points(group="vllm.general_plugins"))


def unregistered_plugin_refusal(env: Mapping[str, str]) -> str | None:
    """Why vLLM would fail on the first layer: `env` switches on a feature that this plugin
    must register, and this Python has no such entry point (hyperqwen imported from a source
    folder on PYTHONPATH, never installed), so vLLM would never call `register`."""
    from hyperqwen.engine.features import FEATURES, OFF

    needing = [
        feature.turned_on_by or f"{feature.knob}={env[feature.env]}"
        for feature in FEATURES
        if feature.registers and env.get(feature.env, OFF) not in (OFF, "off")
    ]
    if not needing:
        return None
    if entry_point_installed():
        return None
    return (
        f"{', '.join(needing)} needs HyperQwen's vLLM plugin, which vLLM finds through the "
        "installed package's `vllm.general_plugins` entry point; this Python has none (is "
        "hyperqwen imported from a source folder on PYTHONPATH?). Install the package: bash "
        "install.sh, or pip install -e . in the checkout"
    )
