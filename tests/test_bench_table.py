"""`hyperqwen bench table`: chosen rows of result files side by side, on files written here."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_in_process

from hyperqwen.bench.results import comparison_row, result_document

FACTS = {
    "gpu": "NVIDIA H200",
    "vllm": "0.26.0",
    "commit": "abc123",
    "date": "2026-12-05T10:00:00+0000",
    "command": "hyperqwen bench ab ...",
    "model": "synth-27b",
}


def write(path: Path, rows: list[tuple[str, str, float | None, float | None]]) -> Path:
    document = result_document(FACTS, [comparison_row(*row) for row in rows])
    path.write_text(json.dumps(document))
    return path


def test_variants_against_one_stock_half_line_up(tmp_path, capsys):
    base = write(tmp_path / "v1.json", [("c1_decode", "tok/s", 200.0, 240.0),
                                        ("c1_tpot", "ms", 5.0, 4.0),
                                        ("step_gpu_ms", "ms", 13.0, 9.75)])  # fmt: skip
    twin = write(tmp_path / "v2.json", [("c1_decode", "tok/s", 200.0, 260.0),
                                        ("c1_tpot", "ms", 5.0, 3.8)])  # fmt: skip
    assert run_in_process("bench", "table", str(base), str(twin), "--labels", "base,twin") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["row", "unit", "stock", "base", "twin"]
    assert lines[1].split() == ["c1_decode", "tok/s", "200", "240", "(1.2x)", "260", "(1.3x)"]
    assert lines[2].split() == ["c1_tpot", "ms", "5", "4", "(0.8x)", "3.8", "(0.76x)"]
    # a row one file lacks is shown as missing there, not left out
    assert lines[3].split() == ["step_gpu_ms", "ms", "13", "9.75", "(0.75x)", "-"]
    # the default rows: only those the files have
    assert run_in_process("bench", "table", str(base), str(twin)) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["row", "unit", "stock", "v1", "v2"]


def test_patterns_choose_rows_in_their_order(tmp_path, capsys):
    path = write(tmp_path / "r.json", [("c1_decode", "tok/s", 1.0, 2.0),
                                       ("c4_decode", "tok/s", 1.0, 3.0),
                                       ("step_gpu_ms", "ms", 2.0, 1.0)])  # fmt: skip
    assert run_in_process("bench", "table", str(path), "--rows", "step_*", "c*_decode") == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert names == ["step_gpu_ms", "c1_decode", "c4_decode"]


def test_stock_halves_that_differ_are_shown_per_file(tmp_path, capsys):
    one = write(tmp_path / "a.json", [("c1_decode", "tok/s", 200.0, 240.0)])
    other = write(tmp_path / "b.json", [("c1_decode", "tok/s", 190.0, 240.0)])
    assert run_in_process("bench", "table", str(one), str(other)) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "differs" in line and "vs stock 200" in line and "vs stock 190" in line


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    path = write(tmp_path / "r.json", [("c1_decode", "tok/s", 1.0, 2.0)])
    assert run_in_process("bench", "table", str(path), "--rows", "nothing*") == 2
    assert "no row matches nothing*" in capsys.readouterr().err
    assert run_in_process("bench", "table", str(path), "--labels", "a,b") == 2
    assert "--labels names 2 files, 1 given" in capsys.readouterr().err
    assert run_in_process("bench", "table", str(tmp_path / "missing.json")) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
