"""Engine code HyperQwen adds to vLLM; patches/ holds the thin hooks that call it."""
