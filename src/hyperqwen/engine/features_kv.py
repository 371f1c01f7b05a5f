"""The engine features of the KV cache, declared: KVarN (KV=kvarn) and its value bits. Part of
the registry: features.py imports them into FEATURES and re-exports them (features.KVARN is the
API), and what its docstring says of a declaration holds here. Runs inside vLLM: the standard
library only.
"""

from __future__ import annotations

from hyperqwen.engine.feature_model import ATTENTION_KV_SPEC, ON, Feature, Knob

KVARN = Feature(
    name="kvarn",
    seams=(ATTENTION_KV_SPEC,),
    registers=True,
    own_files=("src/hyperqwen/kvarn",),
    env="HYPERQWEN_KV_KVARN",
    knob="KV",
    turned_on_by="KV=kvarn",
    launch=lambda settings, mode: ON if settings.KV == "kvarn" else None,
    status="off (on with KV=kvarn); the vLLM plugin registers `../kvarn/backend.py` under "
    "vLLM's CUSTOM attention backend and the launcher selects it for the full-attention "
    "layers: 4-bit K / 2-bit V tiles (3-bit V: KVARN_V_BITS) of 128 tokens in uint8 pages "
    "(this seam sizes them), the sink and filling tiles also in a 16-bit side cache of a few "
    "slots per sequence "
    "(`../kvarn/slots.py`), allocated in vLLM's profile run so that its budget counts it; "
    "decode by the fused Triton kernel, "
    "prefill by a Triton kernel over the same tiles (checked on the H200, not timed), "
    "no CUDA graphs for attention, SPEC=mtp with at most 3 drafts; "
    "CPU-tested (`tests/test_kvarn_backend.py`, `tests/test_engine_kvarn.py`) and served on the "
    "H200, with MTP too (`tests/test_kvarn_serve_gpu.py`; "
    "bench/measurements/2026-12-03-h200-kvarn-*.json); speed not measured",
)


KVARN_V_BITS = Feature(
    name="kvarn_v_bits",
    seams=(),  # no seam: KV=kvarn's backend builds its tile layout with the module's value_bits
    env="HYPERQWEN_KVARN_V_BITS",
    knob="KVARN_V_BITS",
    unset="2",
    owned_knob=Knob(
        "2",
        "With KV=kvarn: the bits of each value (V) element in KVarN's tiles, 2 or 3 (keys keep "
        "4). 3 takes about 15% more bytes per token (src/hyperqwen/kvarn/layout.py's table; "
        "the launcher's capacity sizing and `hyperqwen capacity` count it); in a CPU study on "
        "SmolLM2 it cut the prompt perplexity lost to the cache to a third or less "
        "(bench/measurements/2026-12-06-cpu-smollm2-kv-format-sim*.json). Not run on a GPU "
        "yet, so 2 (issue 25's format) stays the default.",
        values=("2", "3"),
    ),
    # unset is 2, so the default launch sets nothing
    launch=lambda settings, mode: (
        settings.KVARN_V_BITS if settings.KV == "kvarn" and settings.KVARN_V_BITS != "2" else None
    ),
    ignored=lambda settings, mode: (
        "KVARN_V_BITS is ignored without KV=kvarn (it sets the bits of KVarN's values)."
        if settings.KV != "kvarn"
        else None
    ),
    kvarn_value_bits=True,
    status="2 by default; with KV=kvarn and 3, KVarN's tiles store 3-bit values (each code's "
    "third bit in a plane of its own after the 2-bit tile's sections, `../kvarn/layout.py`), "
    "the backend's pages, pool and kernels (store, dequantize, decode, prefill) follow the "
    "variable, and so does the launcher's capacity sizing; CPU-tested (the kernels against "
    "float64 under the interpreter, the backend's pages and steps, "
    "`tests/test_kvarn_*.py`); not run on a GPU yet; why: a CPU study of SmolLM2's prompt "
    "perplexity (bench/measurements/2026-12-06-cpu-smollm2-kv-format-sim*.json)",
)
