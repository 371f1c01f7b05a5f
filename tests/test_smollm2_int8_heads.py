"""Issue 4: `hyperqwen prepare`'s int8 lm_head/embed_tokens cost a real model under +1 % perplexity.

SmolLM2-135M-Instruct (tied embedding and lm_head) is converted twice by `hyperqwen bench
smollm2`, plain and `--int8-heads`, both in bf16 as the real base is, so the two folders differ
by the int8 round trip alone. transformers scores both in float32 over the perplexity battery's
real-text windows (quality_ppl's sources and window cutter; the tokenizer here stands in for
the server's /tokenize). CPU, about 100 s with the default windows;
HYPERQWEN_INT8_HEADS_WINDOWS sets the windows per source (prepare/README.md reports 32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import pytest

from hyperqwen.bench import smollm2
from hyperqwen.bench.quality_ppl import (
    DOCUMENT_SEPARATOR,
    PPL_SOURCES,
    SourceScore,
    combine,
    cut_windows,
)
from hyperqwen.bench.workload import DatasetMissing
from hyperqwen.prepare.marker import Options

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

WINDOW_TOKENS = 512
WINDOWS_PER_SOURCE = int(os.environ.get("HYPERQWEN_INT8_HEADS_WINDOWS", "2"))
# The target: int8 heads may raise perplexity by at most 1 %.
PPL_TOLERANCE = 0.01
EMBEDDING = "model.embed_tokens.weight"


def convert(out: Path, *flags: str) -> Path:
    parser = argparse.ArgumentParser(prog="hyperqwen bench")
    smollm2.add_smollm2_subcommand(parser.add_subparsers(required=True))
    args = parser.parse_args(["smollm2", str(out), "--dtype", "bfloat16", *flags])
    assert args.func(args) == 0, f"hyperqwen bench smollm2 {out} {' '.join(flags)} failed"
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        smollm2.smollm2_gguf()
    except smollm2.Smollm2Missing as missing:
        pytest.skip(str(missing))
    absent = [
        name for name in smollm2.CONVERTER_NEEDS.split() if not importlib.util.find_spec(name)
    ]
    if absent:
        pytest.skip(f"{' '.join(absent)} missing: pip install {smollm2.CONVERTER_NEEDS}")
    root = tmp_path_factory.mktemp("smollm2")
    return {
        "plain": convert(root / "plain"),
        "int8-heads": convert(root / "int8-heads", "--int8-heads"),
    }


def battery_windows(tokenizer) -> dict[str, list[list[int]]]:
    """Each perplexity source's first WINDOWS_PER_SOURCE windows, cut as the battery cuts them."""
    windows = {}
    for source, documents_of in PPL_SOURCES.items():
        try:
            documents, _ = documents_of()
        except DatasetMissing as missing:
            pytest.skip(str(missing))
        # As the battery's /tokenize call: document + separator, no special tokens.
        streams = (
            tokenizer(document + DOCUMENT_SEPARATOR, add_special_tokens=False).input_ids
            for document in documents
        )
        windows[source] = cut_windows(streams, WINDOW_TOKENS, WINDOWS_PER_SOURCE)
        assert len(windows[source]) == WINDOWS_PER_SOURCE, f"{source} ran out of text"
    return windows


def score(model_dir: Path, windows: dict[str, list[list[int]]]) -> dict[str, SourceScore]:
    """Per source, the summed NLL of tokens 2..n of every window, float32 on the CPU."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scores = {}
    with torch.inference_mode():
        for source, source_windows in windows.items():
            nll_sum = 0.0
            for window in source_windows:
                ids = torch.tensor([window])
                logits = model(ids).logits[0, :-1]
                nll_sum += torch.nn.functional.cross_entropy(
                    logits, ids[0, 1:], reduction="sum"
                ).item()
            scored = sum(len(window) - 1 for window in source_windows)
            scores[source] = SourceScore(len(source_windows), scored, nll_sum)
    scores["overall"] = combine(scores.values())
    return scores


@pytest.fixture(scope="module")
def perplexities(folders: dict[str, Path]) -> dict[str, dict[str, SourceScore]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["plain"])
    windows = battery_windows(tokenizer)
    return {name: score(folder, windows) for name, folder in folders.items()}


def test_only_the_tied_embedding_changes_by_the_recorded_round_trip(folders) -> None:
    plain, int8_heads = folders["plain"], folders["int8-heads"]
    assert (plain / "config.json").read_text() == (int8_heads / "config.json").read_text()
    record = json.loads((int8_heads / smollm2.INT8_HEADS_RECORD).read_text())
    assert record["tie_word_embeddings"] is True
    assert list(record["modules"]) == ["model.embed_tokens"]
    module = record["modules"]["model.embed_tokens"]
    assert module["serves"] == ["model.embed_tokens", "lm_head"]
    assert (module["bits"], module["group_size"], module["last_group_columns"]) == (8, 128, 64)
    # prepare would accept these weights: under its default --max-error bound.
    assert 0 < module["relative_error"] <= Options().max_error

    before = safetensors_torch.load_file(plain / "model.safetensors")
    after = safetensors_torch.load_file(int8_heads / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert "lm_head.weight" not in after  # tied: the one embedding tensor serves both
    for name in before:
        if name != EMBEDDING:
            assert torch.equal(before[name], after[name]), name
    # In float64: a float32 norm over the 28M elements is off by ~1e-3 relative.
    difference = (after[EMBEDDING].double() - before[EMBEDDING].double()).abs()
    assert difference.max().item() == pytest.approx(module["max_abs_error"], abs=1e-6)
    relative = difference.norm() / before[EMBEDDING].double().norm()
    assert relative.item() == pytest.approx(module["relative_error"], abs=1e-6)


def test_int8_heads_perplexity_within_one_percent(perplexities, capsys) -> None:
    plain, int8_heads = perplexities["plain"], perplexities["int8-heads"]
    with capsys.disabled():
        print(f"\nSmolLM2-135M, {WINDOWS_PER_SOURCE} x {WINDOW_TOKENS}-token windows per source")
        for source in plain:
            delta = int8_heads[source].ppl / plain[source].ppl - 1
            print(
                f"{source:>9}: plain ppl {plain[source].ppl:.4f}, int8-heads ppl "
                f"{int8_heads[source].ppl:.4f}, delta {delta:+.3%}"
            )
    for source in plain:
        assert int8_heads[source].ppl <= plain[source].ppl * (1 + PPL_TOLERANCE), source
    # The transform did something: the int8 folder scores differently.
    assert int8_heads["overall"].nll_sum != plain["overall"].nll_sum
