"""`bench draft-replay`: the decode steps a drafting policy needs for answers already measured.

Greedy verification is lossless, so an answer's tokens are the same whatever drafts are
proposed; only how many of them a step accepts changes. Replayed on the CPU over the answers a
`bench quoting` run kept (one configuration's, tokenized again with the served model's
tokenizer, after its prompt rendered by the model's chat template), a policy proposes at every
step from the context so far, the step accepts the proposal's longest prefix that agrees with
the answer, then makes one token more. Per kind: decode steps, the share of them that drafted,
tokens per decode step (steps without drafts included), vLLM's tokens per drafting step (to
hold against the run's own counters) and, given `bench quoting-ceiling` files, the projected
27B speed (quoting_ceiling_result.mixed_step_ms) where they measured the policy's width, and
the most any width could make (every step at k0's time; "27B at most"), which rules a width out
without its own step: its bound below another's projection.

Policies: `lookup-kK` (engine/lookup.propose: SPEC=lookup's search and count policy with
LOOKUP_MATCH) and `ngram-kK` (vLLM 0.26's own CPU n-gram search with the launcher's
NGRAM_MATCH), K drafts at most. Re-tokenized text can differ from the served tokens at a few
places, so the replay is an estimate of the run, which its tokens per drafting step beside the
measured ones shows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hyperqwen.bench.quoting_ceiling_result import CEILING_KIND, CEILING_SCHEMA, mixed_step_ms
from hyperqwen.bench.quoting_ceiling_run import config_name, step_figures
from hyperqwen.bench.quoting_configs import HYPERQWEN_BASELINE
from hyperqwen.bench.quoting_result import (
    DecodeCounts,
    figures as run_figures,
    load_measurements,
    merge,
)
from hyperqwen.bench.quoting_run import save
from hyperqwen.bench.quoting_tasks import KINDS, salt
from hyperqwen.bench.results import ResultFileError, aligned
from hyperqwen.exit_codes import EXIT_BAD_INPUT
from hyperqwen.launch import LOOKUP_MATCH, NGRAM_MATCH

# DRAFT_TOKENS' bound (the CPU searches take up to 31)
MAX_DRAFTS = 31
DEFAULT_POLICIES = "lookup-k15,lookup-k8,lookup-k4,ngram-k15,ngram-k8,ngram-k4"
# No model length limit in a replay: every answer fitted its server's.
UNLIMITED = 1 << 30
# The end-of-answer token, as no tokenizer numbers one
END = -1

Propose = Callable[[np.ndarray], Sequence[int]]


def policy(name: str) -> Propose:
    """`lookup-kK` or `ngram-kK` as a function of the context; ValueError naming the word."""
    method, _, drafts = name.partition("-k")
    if method not in ("lookup", "ngram") or not drafts.isdigit():
        raise ValueError(f"{name!r}: give lookup-kK or ngram-kK, K drafts (1-{MAX_DRAFTS})")
    k = int(drafts)
    if not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"{name!r}: K is 1 to {MAX_DRAFTS}")
    if method == "lookup":
        from hyperqwen.engine.lookup import propose

        return lambda context: propose(context, *LOOKUP_MATCH, k, UNLIMITED)
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllms_search,
    )

    return lambda context: vllms_search(context, *NGRAM_MATCH, UNLIMITED, k)


def figures(counts: DecodeCounts) -> dict[str, float | None]:
    return {
        "steps": counts.steps,
        "drafting_steps_pct": counts.drafting_pct,
        "tokens_per_any_step": counts.tokens_per_any_step,
        "tokens_per_drafting_step": counts.tokens_per_drafting_step,
    }


def replay(prompt: Sequence[int], answer: Sequence[int], propose: Propose) -> DecodeCounts:
    """The decode steps of one answer under `propose`. Its first token is the prefill's; after
    its last, the step that ends it makes the end-of-answer token (END, which no draft equals),
    so decode tokens = steps + accepted drafts, as vLLM counts them."""
    tokens = np.asarray([*prompt, *answer, END], dtype=np.int64)
    end = len(tokens)
    counts = DecodeCounts(decode_tokens=len(answer))
    at = len(prompt) + 1
    while at < end:
        drafts = list(propose(tokens[:at]))
        agree = 0
        while agree < len(drafts) and at + agree < end and drafts[agree] == tokens[at + agree]:
            agree += 1
        counts.drafting_steps += bool(drafts)
        counts.accepted += agree
        at += agree + 1
    return counts


def tokenized_answers(measurements: dict, config: str, tokenizer) -> dict[str, list[tuple]]:
    """Per kind, (prompt ids, answer ids) of every request of every pass of `config`."""
    prompts = measurements["prompts"].get("texts")
    if not prompts:
        raise ResultFileError(
            "the measurements keep no prompt texts (`bench quoting` runs of 2026-12-06 and "
            "before): measure again"
        )
    record = measurements["configs"].get(config)
    if record is None:
        raise ResultFileError(
            f"--config {config}: not measured there; measured: {', '.join(measurements['configs'])}"
        )
    seed = measurements["plan"]["seed"]
    pairs: dict[str, list[tuple]] = {kind: [] for kind in KINDS}
    for number, kinds in enumerate(record["passes"], 1):
        for kind in KINDS:
            for index, (prompt, text) in enumerate(zip(prompts[kind], kinds[kind]["texts"],
                                                       strict=True)):  # fmt: skip
                content = f"{salt(seed, str(number), kind, index)} {prompt}"
                rendered = tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
                answer = tokenizer.encode(text, add_special_tokens=False)
                pairs[kind].append((list(rendered), answer))
    return pairs


def ceiling_steps(paths: Sequence[Path]) -> dict[str, float | None]:
    """Step time (ms) per ceiling configuration of `bench quoting-ceiling` files."""
    if not paths:
        return {}
    merged = merge(load_measurements(paths), CEILING_KIND, CEILING_SCHEMA, ("plan",))
    return {name: step_figures(record).step_ms for name, record in merged["configs"].items()}


def projected(figures: dict, drafts: int, steps_ms: dict[str, float | None]) -> float | None:
    """27B tok/s: tokens per decode step over the mixed step time (None where unmeasured)."""
    step_ms = mixed_step_ms(
        figures["drafting_steps_pct"], steps_ms.get(config_name(drafts)), steps_ms.get("k0")
    )
    return tok_s(figures["tokens_per_any_step"], step_ms)


def bound(figures: dict, steps_ms: dict[str, float | None]) -> float | None:
    """27B tok/s if every step cost a plain one (k0's): a step verifying drafts costs at least
    that, so no width does better; it compares a width whose step is unmeasured."""
    return tok_s(figures["tokens_per_any_step"], steps_ms.get("k0"))


def tok_s(tokens_per_step: float | None, step_ms: float | None) -> float | None:
    return round(1000 * tokens_per_step / step_ms, 1) if step_ms and tokens_per_step else None


def replay_all(pairs: dict[str, list[tuple]], names: Sequence[str], steps_ms) -> dict:
    """Policy -> kind -> figures (and projected_27b_tok_s where the ceiling has its k,
    bound_27b_tok_s where it has k0)."""
    table = {}
    for name in names:
        propose = policy(name)
        drafts = int(name.partition("-k")[2])
        table[name] = {}
        for kind, kind_pairs in pairs.items():
            total = DecodeCounts()
            for prompt, answer in kind_pairs:
                total.add(replay(prompt, answer, propose))
            kind_figures = figures(total)
            if steps_ms:
                kind_figures["projected_27b_tok_s"] = projected(kind_figures, drafts, steps_ms)
                kind_figures["bound_27b_tok_s"] = bound(kind_figures, steps_ms)
            table[name][kind] = kind_figures
    return table


def format_table(table: dict, measured: dict[str, dict]) -> list[str]:
    lines = [("policy", "kind", "steps", "drafted", "tok/any step", "tok/drafting step",
              "measured", "27B tok/s", "27B at most")]  # fmt: skip
    for name, kinds in table.items():
        for kind, figures in kinds.items():
            lines.append(tuple(
                "-" if value is None else str(value)
                for value in (name, kind, figures["steps"], figures["drafting_steps_pct"],
                              figures["tokens_per_any_step"], figures["tokens_per_drafting_step"],
                              measured.get(name, {}).get(kind),
                              figures.get("projected_27b_tok_s"), figures.get("bound_27b_tok_s"))
            ))  # fmt: skip
    return aligned(lines)


def cmd_draft_replay(args: argparse.Namespace) -> int:
    try:
        names = [word.strip() for word in args.policies.split(",") if word.strip()]
        for name in names:
            policy(name)
        measurements = merge(load_measurements([Path(path) for path in args.measurements]))
        steps_ms = ceiling_steps([Path(path) for path in args.ceiling])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        pairs = tokenized_answers(measurements, args.config, tokenizer)
    except (ValueError, ResultFileError, OSError) as error:
        print(f"hyperqwen bench draft-replay: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    table = replay_all(pairs, names, steps_ms)
    # the run's own tokens per drafting step, for the configurations named like a policy
    # (ngram-k15, ...): quoting_result's figures, mean of the passes
    named = {name: record for name, record in measurements["configs"].items() if name in names}
    kept, _ = run_figures(named)
    measured = {name: {kind: kept[kind, name].tokens_per_step for kind in KINDS} for name in named}
    print("\n".join(format_table(table, measured)))
    if args.out:
        document = {"command": " ".join(sys.argv), "measurements": args.measurements,
                    "config": args.config, "ceiling": args.ceiling, "policies": table}  # fmt: skip
        save(Path(args.out), document)
        print(f"wrote {args.out}")
    return 0


def add_subcommand(actions) -> None:
    parser = actions.add_parser(
        "draft-replay",
        help="replay measured greedy answers through drafting policies (CPU): steps, drafting "
        "share, tokens per step, projected 27B speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: hyperqwen bench draft-replay quoting-j.json --tokenizer /tmp/smollm2 "
        "--ceiling ceiling-a.json --policies lookup-k15,ngram-k15 --out replay.json",
    )
    parser.add_argument(
        "measurements",
        nargs="+",
        metavar="MEASUREMENTS.json",
        help="`bench quoting` measurements files (one run; they merge)",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="the served model's folder (its tokenizer and chat template)",
    )
    parser.add_argument(
        "--config",
        default=HYPERQWEN_BASELINE,
        metavar="NAME",
        help="whose answers to replay (default %(default)s: no speculation)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="LIST",
        help="comma separated lookup-kK / ngram-kK (default %(default)s)",
    )
    parser.add_argument(
        "--ceiling",
        nargs="*",
        default=[],
        metavar="STEPS.json",
        help="`bench quoting-ceiling` files: each policy's projected 27B tok/s and its k0 bound",
    )
    parser.add_argument("--out", metavar="PATH", help="the table as JSON")
    parser.set_defaults(func=cmd_draft_replay)
