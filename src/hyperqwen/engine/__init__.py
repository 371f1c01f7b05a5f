"""Engine code HyperQwen adds to vLLM; patches/ holds the thin hooks that call it.

Modules here run inside vLLM's processes, so they import neither the launcher's settings nor
anything vLLM itself does not bring. Each feature, with its knob and environment variable, is
declared once in `features.py`.
"""

from hyperqwen.engine.features import compile_factors

# patches/compile-cache-key.patch imports it from here
__all__ = ["compile_factors"]
