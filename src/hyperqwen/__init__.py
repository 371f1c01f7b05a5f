"""HyperQwen: large Qwen models served fast on consumer NVIDIA cards (pinned, patched vLLM)."""

__version__ = "0.1.0"
