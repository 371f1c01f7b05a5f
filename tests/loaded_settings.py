"""Settings as the launcher gets them from an env file, for tests: `loaded(KNOB="value", ...)`."""

from __future__ import annotations

from hyperqwen.settings import LoadedSettings, Settings


def loaded(**values: str) -> LoadedSettings:
    """These knob values, each counted as set explicitly (as a line of the env file)."""
    return LoadedSettings(Settings.model_validate(values), frozenset(values))
