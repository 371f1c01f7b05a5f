"""Whether HyperQwen's kernels launch with programmatic dependent launch (PDL, knob PDL).

No seam: the launchers in ../kernels ask `for_capability` (through kernels/pdl.py) at each
launch. PDL is a Hopper feature (sm90 and newer: H100/H200, RTX 5090); below it (A100, RTX
3090/4090: sm80/86/89) the kernels launch exactly as without the knob. PDL=1 where `hyperqwen
serve` sees a card below sm90 is refused there (`serve_refusal`); where the card is only known at a
kernel's launch (the kernels called outside `hyperqwen serve`), 1 is ignored there with one
logged warning per card.

Runs inside vLLM: the standard library and features.py only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hyperqwen.engine.features import ON, PDL, env_value

MIN_CAPABILITY = (9, 0)
_NEEDS = "PDL=1 needs compute capability 9.0 or newer (Hopper: H100/H200, or an RTX 5090)"
_log = logging.getLogger(__name__)


def decide(setting: str, capability: tuple[int, int]) -> bool:
    """Whether a kernel on a card of this compute capability launches with PDL at this PDL
    value (auto, 0 or 1; 1 below sm90 is the caller's to refuse or report)."""
    return setting != "0" and tuple(capability) >= MIN_CAPABILITY


def serve_refusal(setting: str, gpus: Iterable[Any], model_dir: Path) -> str | None:
    """Why PDL=`setting` cannot serve on these GPUs (hyperqwen.gpu.Gpu), or None; any model."""
    if setting != ON:
        return None
    from hyperqwen.gpu import cards_below  # `hyperqwen serve`'s side only: not in vLLM's

    short = cards_below(gpus, MIN_CAPABILITY)
    if not short:
        return None
    return (
        f"{_NEEDS}; this machine has {', '.join(short)}. Use PDL=auto (on where the card has "
        "it) or PDL=0."
    )


@functools.cache
def for_capability(capability: tuple[int, int]) -> bool:
    """This process's decision for a card of this capability: the PDL variable (a value it
    does not take is refused by name), 1 below sm90 logged once and launched without PDL."""
    setting = env_value(PDL)
    if setting == ON and not decide(setting, capability):
        sm = f"sm{capability[0]}{capability[1]}"
        _log.warning("%s: %s; this card is %s: launched without PDL.", PDL.env, _NEEDS, sm)
    return decide(setting, capability)
