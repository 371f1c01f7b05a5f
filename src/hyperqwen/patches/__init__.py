"""The patch series for the pinned vLLM: `hyperqwen patches apply|verify|list`.

`patches/series` lists the diffs in apply order, one file name per line (`#` starts a
comment). Each diff is a unified diff with paths relative to the `vllm/` package directory
(`--- a/entrypoints/...` / `+++ b/entrypoints/...`, applied with `-p1`; new files come from
`--- /dev/null`). Before its first `--- ` line a diff carries a preamble with the fields
`Kind:` (fix|feature|backport|local), `What:`, `Upstream:` (a URL or "none") and
`Retires-when:`; `PATCHES.md` is generated from these preambles.

`series` reads and validates the series file and the diffs (preambles, file sections, hunk
line counts), `tree` checks and applies them to a vLLM tree with GNU patch, and `cli` renders
the listings (PATCHES.md among them) and holds the `hyperqwen patches` subcommand.
"""
