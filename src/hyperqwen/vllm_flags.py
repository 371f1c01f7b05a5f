"""`vllm serve` flags read as vLLM's own parser reads them: the one reader the launcher and
`bench ab` share.

vLLM's FlexibleArgumentParser takes every long flag with `_` for `-` (--max_num_seqs), a few
short aliases (-tp, -sc, -cc), `--flag=value` as well as `--flag value`, `--no-flag` for a
boolean one and `--json-flag.key=value` for one key of a JSON flag. A reader that knows fewer
spellings misses a flag the server will use.
"""

from __future__ import annotations

from dataclasses import dataclass

# Short spellings vLLM's parser accepts for flags the launcher sets; a test checks each
# against vLLM's own parser, so this list cannot go stale silently.
FLAG_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-sc": "--speculative-config",
    "-cc": "--compilation-config",
}
SPECULATIVE_CONFIG = "--speculative-config"


@dataclass(frozen=True)
class FlagToken:
    """One argv token that names a flag, in vLLM's canonical spelling."""

    name: str
    """The long flag it sets, as vLLM's help spells it: --speculative-config for -sc,
    --speculative_config and --speculative-config.method; --enable-prefix-caching for
    --no-enable-prefix-caching."""
    negated: bool
    """--no-NAME: a boolean flag turned off."""
    key: str | None
    """`method` of --speculative-config.method=ngram: one key of a JSON flag, not its value."""
    inline: bool
    """--flag=value: the value is in this token, not the next."""


def read_flag(token: str) -> FlagToken | None:
    """The flag a token names, or None for a value (a negative number is one too)."""
    if not token.startswith("-") or token == "-" or _is_number(token):
        return None
    spelled, equals, _ = token.partition("=")
    spelled, _, key = spelled.partition(".")
    # vLLM turns `_` into `-` between the leading dashes and the first dot only.
    name = FLAG_ALIASES.get(spelled, spelled).replace("_", "-")
    negated = name.startswith("--no-")
    if negated:
        name = "--" + name[len("--no-") :]
    return FlagToken(name, negated, key or None, bool(equals))


def flag_name(token: str) -> str | None:
    """The canonical long flag a token sets, or None for values."""
    flag = read_flag(token)
    return flag.name if flag else None


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def value_positions(argv: list[str], name: str) -> list[tuple[int, str]]:
    """(index, prefix) of every whole value of the flag `name` (canonical) in argv, in order:
    argv[index][len(prefix):] is the value (`FLAG VALUE`, or `FLAG=VALUE` with the flag as
    spelled there plus `=` for prefix). The index is len(argv) for a flag that ends argv without
    its value. Keys of a JSON flag (--flag.key=v) and --no-flag carry no whole value."""
    positions = []
    for index, token in enumerate(argv):
        flag = read_flag(token)
        if flag is None or flag.name != name or flag.negated or flag.key:
            continue
        positions.append((index, token.partition("=")[0] + "=") if flag.inline else (index + 1, ""))
    return positions


def flag_value(argv: list[str], name: str) -> str | None:
    """The value vLLM keeps for the flag `name` (canonical): the last one given, else None."""
    positions = [(i, prefix) for i, prefix in value_positions(argv, name) if i < len(argv)]
    if not positions:
        return None
    index, prefix = positions[-1]
    return argv[index][len(prefix) :]


def flag_keys(argv: list[str], name: str) -> list[str]:
    """The tokens that set one key of the JSON flag `name` (--flag.key=v, -sc.key v)."""
    keyed = [(token, read_flag(token)) for token in argv]
    return [token for token, flag in keyed if flag and flag.name == name and flag.key]


def speculates(argv: list[str]) -> bool:
    """Whether a `vllm serve` argv gives the server a --speculative-config, in any spelling."""
    return any(flag_name(token) == SPECULATIVE_CONFIG for token in argv)
