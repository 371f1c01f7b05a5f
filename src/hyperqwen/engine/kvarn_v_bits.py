"""KVARN_V_BITS inside vLLM: how many bits each value takes in KV=kvarn's tiles, 2 or 3.

No seam: KV=kvarn's backend (../kvarn/backend.py) builds its tile layout (../kvarn/layout.py)
with `value_bits`, so the pages it declares at the attention_kv_spec seam, its pool and its
kernels all take the variable's bits. A value the variable does not take is refused by name
(the vLLM plugin checks every feature's variable before the model loads).

Runs inside vLLM: the standard library and features.py only.
"""

from __future__ import annotations

from hyperqwen.engine.features import KVARN_V_BITS, env_value


def value_bits() -> int:
    """This process's bits per value: the variable, unset read as 2."""
    return int(env_value(KVARN_V_BITS))
