"""KVarN: a 4-bit K / 2-bit V (or 3-bit V: KVARN_V_BITS) KV cache in 128-token tiles for the
full-attention layers (issue 25, item 3). layout.py is the packed tile and pool, hadamard.py the
rotation, quantize.py the float64 reference encoding, store.py and dequant.py the Triton tile
kernels, attention.py the read and write rules and a float64 attention over them, decode.py the
fused split-K decode attention, slots.py the 16-bit side cache's slot allocator and sizing.py
its size, fit.py the kernels' shared memory per GPU architecture, bench.py the decode
microbenchmark, backend.py the vLLM attention backend that KV=kvarn registers
(../engine/kvarn.py). README.md says what is done and what is next."""
