"""Benchmarks against a running HyperQwen server: `hyperqwen bench ...`.

client (HTTP, SSE timing, /metrics counters), workload (prompts: ShareGPT and random tokens,
salted or shared), rows (the ROW line format and per-pass statistics), run (cohorts, warm-up,
concurrency, results JSON), options (the workload options `run` and `ab` share), header
(comparability facts), plot (PNG), cli (the subcommands).
`bench ab`: ab (the command), ab_plan (its frozen options), ab_argv (each side's vLLM argv),
ab_run (one side measured), server_process (a server's start, health and stop), ab_compare
(ratio rows, the result document), ab_state (the stock half between phases), results (the
result schema, publish, docs). Kernel benchmarks: kernels, gdn, draft-head, on timing's harness.
"""

from hyperqwen.bench.cli import add_subcommand

__all__ = ["add_subcommand"]
