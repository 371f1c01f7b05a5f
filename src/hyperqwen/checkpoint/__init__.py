"""Qwen3.5-architecture checkpoints on disk: geometry, weight layout, the W4A16 format, files.

`geometry` says how big the model is, `layout` names every tensor vLLM's `qwen3_5` loader
expects, `w4a16` owns the compressed-tensors pack-quantized format (pack, unpack, read,
config), `shards` writes and reads sharded safetensors, `tokenizer` and `config_json` write the
side files, and `synthesize` puts them together into a servable checkpoint directory.
"""
