"""Engine code HyperQwen adds to vLLM; patches/ holds the thin hooks that call it.

Modules here run inside vLLM's processes, so they import neither the launcher's settings nor
anything vLLM itself does not bring; the names the launcher and the engine share live here.
"""

# How Settings.DRAFT_VOCAB reaches the patched vLLM (engine/draft_vocab.py reads it there).
DRAFT_VOCAB_ENV = "HYPERQWEN_DRAFT_VOCAB"
DRAFT_VOCAB_CHOICES = ("auto", "off")

# Set to "1" by the launcher with SPEC=lookup (vLLM's CPU n-gram proposer then drafts from
# HyperQwen's longest-latest match, engine/lookup.py, instead of its earliest one) and with
# SPEC=mtp LOOKUP=1 (the same search fused with MTP's drafts).
LOOKUP_ENV = "HYPERQWEN_LOOKUP"

# Set to "1" by the launcher with PREFIX_CACHE_OVERLAP=1: vLLM's V1 runner skips its per-step wait
# for the previous step's accepted counts where prefix caching cannot need them
# (engine/align_overlap.py).
ALIGN_OVERLAP_ENV = "HYPERQWEN_ALIGN_OVERLAP"

# Set to "1" by the launcher with GDN_RECURRENT=1: the GDN layer's decode and verify steps take
# HyperQwen's recurrent-update kernel (engine/gdn_recurrent.py) instead of vLLM's.
GDN_RECURRENT_ENV = "HYPERQWEN_GDN_RECURRENT"

# Set to "1" by the launcher with LINEAR_BACKEND=hyperqwen: vLLM's compressed-tensors W4A16
# layers try HyperQwen's kernel first (engine/w4a16_linear.py), Marlin where it cannot serve.
W4A16_ENV = "HYPERQWEN_W4A16"

# Set to "1" by the launcher with GDN_BA=1: the GDN layer's b and a projections come from one op
# (engine/gdn_ba.py, a skinny kernel at decode and verify) instead of a GEMM, a split and copies.
GDN_BA_ENV = "HYPERQWEN_GDN_BA"

# Every switch above, as vLLM's torch.compile cache key must see them
# (patches/compile-cache-key.patch): some change what the compiled graph holds (W4A16, GDN_BA
# decide at layer construction which ops it calls), and a graph cached with a switch off must
# not be loaded with it on.
ENGINE_SWITCHES = (
    DRAFT_VOCAB_ENV,
    LOOKUP_ENV,
    ALIGN_OVERLAP_ENV,
    GDN_RECURRENT_ENV,
    W4A16_ENV,
    GDN_BA_ENV,
)


def compile_factors() -> dict[str, str | None]:
    """The engine switches' values, for vLLM's compile cache key (unset is None)."""
    import os

    return {name: os.environ.get(name) for name in ENGINE_SWITCHES}
