"""Exit codes every `hyperqwen` command shares: 0 done, 1 the work failed (a server, a run),
2 the input was refused before any work (an option, a file, a tree), 3 no GPU where one is
needed (`hyperqwen serve`). Commands with a narrower meaning name it beside these."""

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
