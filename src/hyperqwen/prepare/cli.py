"""`hyperqwen prepare`: download the base checkpoint if needed, then prepare it for serving."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from hyperqwen.prepare import marker
from hyperqwen.prepare.folder import Refused

EXIT_REFUSED = 2
DEFAULT_RANKING_WORD = "default"

DESCRIPTION = """\
Turn the public compressed-tensors W4A16 base into what the servers load, in place:

  1. lm_head        -> int8 group-128 (same compressed-tensors pack-quantized format);
                       round-trip error measured, refused above --max-error
  2. embed_tokens   -> int8 group-128 (served by HyperQwen's embed-quant vLLM patch)
  3. MTP linears    -> int8 group-128 (--mtp-bits 4 for int4)
  4. draft vocabulary: the special tokens plus the most frequent ids of a ranking (default:
                       ShareGPT assistant text), and the matching rows of the int8 lm_head
                       (hyperqwen-draft-head.safetensors, hyperqwen-draft-vocab.txt)
  5. chat template: tool-call arguments given as an array render; reasoning_effort values the
                       template refuses map to the nearest accepted one

MODEL_DIR defaults to MODELS_DIR/MODEL from the environment and .env. A missing folder is
downloaded first (--repo; resumable). Everything is checked before the first write; writes are
atomic, and an interrupted run resumes where it stopped and ends with the same files. The
base's replaced files are kept in MODEL_DIR/.hyperqwen/pristine/. The steps done, their
options and measured errors go to MODEL_DIR/hyperqwen-prepare.json; options persist, so a plain
`hyperqwen prepare` (the compose service runs it on every `up`) keeps them and returns at once
when nothing is left to do."""


def _epilog() -> str:
    from hyperqwen.prepare.download import DEFAULT_BASE_REPO

    return f"""\
examples:
  hyperqwen prepare                                  # MODELS_DIR/MODEL, download if absent
  hyperqwen prepare --status                         # which steps are done, with their errors
  hyperqwen prepare /models/base --mtp-bits 4        # int4 MTP head
  hyperqwen drafter recount --prompts mine.txt --out ranking.txt
  hyperqwen prepare --draft-vocab ranking.txt        # recut the draft vocabulary
  hyperqwen prepare --skip none                      # every step again, after earlier --skip

The default --repo, {DEFAULT_BASE_REPO}, is the expected name of the public base; it could not
be confirmed from here. Offline: put the base's files (config.json, model.safetensors.index.json,
model-*.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja) into MODEL_DIR.
Exit status: 0 prepared (or already), 2 refused (the message says why and what to do)."""


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="download the base checkpoint and prepare it (int8 head/embed/MTP, draft "
        "vocabulary, chat template)",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        type=Path,
        nargs="?",
        help="model folder [MODELS_DIR/MODEL from the settings]",
    )
    parser.add_argument("--status", action="store_true", help="print which steps are done and exit")
    parser.add_argument(
        "--repo",
        default=None,
        help="Hugging Face repository of the base, downloaded when MODEL_DIR has no "
        "config.json [the default named below]",
    )
    parser.add_argument("--revision", default=None, help="branch, tag or commit of --repo")
    parser.add_argument(
        "--no-download",
        action="store_true",
        help="never download; refuse when the files are not there",
    )
    parser.add_argument(
        "--skip",
        action="append",
        choices=[*marker.STEPS, "none"],
        default=None,
        help="leave a step out (repeatable; persists); a skipped step that was done is undone; "
        "`--skip none` does every step",
    )
    parser.add_argument(
        "--mtp-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="bit width of the MTP linears [8; persists]",
    )
    parser.add_argument(
        "--draft-size",
        type=int,
        default=None,
        metavar="N",
        help="token ids in the draft vocabulary, special tokens included [40960; persists]",
    )
    parser.add_argument(
        "--draft-vocab",
        dest="ranking",
        metavar="FILE",
        default=None,
        help="ranking to cut the draft vocabulary from, as `hyperqwen drafter recount` writes; "
        f"`{DEFAULT_RANKING_WORD}` for the shipped ShareGPT ranking [the one used last]",
    )
    parser.add_argument(
        "--max-error",
        type=float,
        default=None,
        metavar="PERCENT",
        help="largest relative round-trip error (‖W-Ŵ‖/‖W‖) allowed for an int8 tensor, in "
        "percent; int4 tensors get it times 255/15 [1; persists]",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        return args.model_dir
    from hyperqwen.launch import model_path
    from hyperqwen.settings import load_settings

    return model_path(load_settings().settings)


def _ranking(model_dir: Path, explicit: str | None) -> Path:
    """The ranking the draft vocabulary is cut from: the one given, else the one this folder
    was prepared with, else the default shipped with hyperqwen."""
    from hyperqwen.drafter.vocab import DEFAULT_RANKING
    from hyperqwen.prepare.folder import DRAFT_RANKING_FILE

    if explicit == DEFAULT_RANKING_WORD:
        return DEFAULT_RANKING
    if explicit is not None:
        return Path(explicit)
    kept = model_dir / DRAFT_RANKING_FILE
    return kept if kept.is_file() else DEFAULT_RANKING


def resolve_options(args: argparse.Namespace, model_dir: Path, ranking: Path) -> marker.Options:
    """Explicit options win; then the ones the folder was prepared with; then the defaults."""
    recorded = marker.recorded_options(model_dir) or marker.Options()
    skip = recorded.skip
    if args.skip is not None:
        skip = tuple(step for step in marker.STEPS if step in args.skip)
    try:
        digest = hashlib.sha256(ranking.read_bytes()).hexdigest()
    except OSError as error:
        raise Refused(f"--draft-vocab: cannot read {ranking}: {error}") from None
    return marker.Options(
        skip=skip,
        mtp_bits=args.mtp_bits or recorded.mtp_bits,
        draft_size=args.draft_size or recorded.draft_size,
        max_error=args.max_error / 100 if args.max_error is not None else recorded.max_error,
        draft_ranking_sha256=digest,
    )


def _print_step(report) -> None:
    text = marker.describe(report.details)
    timing = f" [{report.seconds:.1f} s]" if report.seconds else ""
    print(f"  {report.title:<44} {report.status}{': ' + text if text else ''}{timing}")
    for key, value in report.details.items():
        if isinstance(value, dict) and value:
            shown = ", ".join(
                f"{name} {f'{item:.3%}' if isinstance(item, float) else item}"
                for name, item in value.items()
            )
            print(f"  {'':<44}   {key.replace('_', ' ')}: {shown}")


def run(args: argparse.Namespace) -> int:
    from hyperqwen.settings import SettingsError

    started = time.monotonic()
    try:
        model_dir = _model_dir(args).absolute()
    except SettingsError as error:
        print(f"hyperqwen prepare: {error}", file=sys.stderr)
        return EXIT_REFUSED
    if args.status:
        print("\n".join(marker.status_lines(model_dir)))
        return 0
    ranking = _ranking(model_dir, args.ranking)
    options = resolve_options(args, model_dir, ranking)
    if marker.is_done(model_dir, options):
        print(
            f"{model_dir}: already prepared ({time.monotonic() - started:.2f} s); "
            "hyperqwen prepare --status shows the steps"
        )
        return 0
    try:
        from hyperqwen.prepare import download

        if download.needs_download(model_dir):
            if args.no_download:
                raise Refused(
                    f"{model_dir} has no config.json and --no-download was given; "
                    + download.PLACE_BY_HAND.format(folder=model_dir)
                )
            repo = args.repo or download.DEFAULT_BASE_REPO
            print(f"downloading {repo} into {model_dir} (resumable) ...")
            download.download(repo, args.revision, model_dir)
        from hyperqwen.prepare.run import prepare

        print(f"preparing {model_dir}")
        reports = prepare(
            model_dir,
            options,
            ranking,
            progress=not args.quiet and os.environ.get("TQDM_DISABLE") != "1",
            on_step=_print_step,
        )
    except Refused as error:
        print(f"hyperqwen prepare: refusing: {error}", file=sys.stderr)
        return EXIT_REFUSED
    done = sum(report.status == "done" for report in reports)
    print(
        f"prepared {model_dir}: {done} step(s) done now, total {time.monotonic() - started:.1f} s"
    )
    return 0
