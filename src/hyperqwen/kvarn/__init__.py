"""KVarN: a 4-bit K / 2-bit V KV cache in 128-token tiles for the full-attention layers
(issue 25, item 3). layout.py is the packed tile and pool, hadamard.py the rotation,
quantize.py the float64 reference encoding, store.py and dequant.py the Triton kernels,
attention.py the read rule and a float64 attention over it. README.md says what is done and
what is next; nothing here is wired into vLLM yet."""
