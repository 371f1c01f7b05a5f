"""Engine code HyperQwen adds to vLLM; patches/ holds the thin hooks that call it.

Modules here run inside vLLM's processes, so they import neither the launcher's settings nor
anything vLLM itself does not bring; the names the launcher and the engine share live here.
"""

# How Settings.DRAFT_VOCAB reaches the patched vLLM (engine/draft_vocab.py reads it there).
DRAFT_VOCAB_ENV = "HYPERQWEN_DRAFT_VOCAB"
DRAFT_VOCAB_CHOICES = ("auto", "off")
