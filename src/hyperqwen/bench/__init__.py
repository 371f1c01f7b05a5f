"""Benchmarks against a running HyperQwen server: `hyperqwen bench ...`.

client (HTTP, SSE timing, /metrics counters), workload (prompts: ShareGPT and random tokens,
salted or shared), rows (the ROW line format and per-pass statistics), run (cohorts, warm-up,
concurrency, results JSON), header (comparability facts), plot (PNG), cli (the subcommands).
"""

from hyperqwen.bench.cli import add_subcommand

__all__ = ["add_subcommand"]
