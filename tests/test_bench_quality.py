"""`hyperqwen bench quality` / `compare` against a real local HTTP server speaking vLLM's protocol.

The server (FastAPI on uvicorn, background thread, free port) tokenizes one token per
character (id = code point), answers /v1/completions with vLLM's prompt_logprobs shape using
logprobs the test controls (plus a decoy top-1 entry, as prompt_logprobs=1 adds), and answers
chat requests from a prompt -> reply table. IFBench answers are scored by IFBench's own
verifiers; nothing of the client or the verifiers is mocked.
"""

from __future__ import annotations

import json
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_runner import run_in_process
from fastapi import FastAPI, Request
from local_server import serving

from hyperqwen.bench.quality import compare_documents
from hyperqwen.bench.quality_gsm8k import extract_answer, reference_answer
from hyperqwen.bench.quality_ifbench import IfbenchMissing, load_prompts, verify
from hyperqwen.bench.quality_ppl import DOCUMENT_SEPARATOR, STDLIB_FILES, window_nll

MODEL = "fake-qwen"
DECOY_TOKEN = 0


def controlled_logprob(token: int) -> float:
    """The logprob the fake server gives a prompt token: -0.1 to -0.5 by the token id."""
    return -((token % 5) + 1) / 10


def build_app(replies: dict[str, str]) -> FastAPI:
    app = FastAPI()

    @app.get("/version")
    async def version() -> dict:
        return {"version": "0.26.0"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await request.json()
        assert body["add_special_tokens"] is False
        tokens = [ord(char) for char in body["prompt"]]
        return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        assert body["prompt_logprobs"] == 0 and not body.get("stream")
        prompt_logprobs = [None] + [
            {
                str(token): {"logprob": controlled_logprob(token), "rank": 2},
                str(DECOY_TOKEN): {"logprob": -0.01, "rank": 1},
            }
            for token in body["prompt"][1:]
        ]
        choice = {"index": 0, "text": "x", "prompt_logprobs": prompt_logprobs}
        return {"choices": [choice]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        assert body["temperature"] == 0.0
        content = replies.get(body["messages"][-1]["content"], "")
        message = {"role": "assistant", "content": content, "reasoning_content": "hmm 99"}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[dict[str, str], str]]:
    replies: dict[str, str] = {}
    with serving(build_app(replies)) as port:
        yield replies, f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def no_stray_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_API_KEY", "PORT", "API_KEY_FILE", "ENV_FILE"):
        monkeypatch.delenv(name, raising=False)


def expected_stdlib_windows(window: int, count: int) -> list[list[int]]:
    stream: list[int] = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        stream += [ord(char) for char in (root / name).read_text() + DOCUMENT_SEPARATOR]
    return [stream[index * window : (index + 1) * window] for index in range(count)]


def test_perplexity_is_the_token_weighted_nll_of_the_served_logprobs(
    server, tmp_path, capsys
) -> None:
    _, url = server
    out = tmp_path / "q.json"
    code = run_in_process("bench",
        "quality", "--url", url, "--ppl-sources", "stdlib", "--window-tokens", "64",
        "--ppl-windows", "3", "--skip-ifbench", "--out", str(out),
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    windows = expected_stdlib_windows(64, 3)
    nll = sum(-controlled_logprob(token) for window in windows for token in window[1:])
    expected_ppl = math.exp(nll / (3 * 63))
    document = json.loads(out.read_text())
    stdlib = document["perplexity"]["sources"]["stdlib"]
    assert (stdlib["windows"], stdlib["scored_tokens"]) == (3, 189)
    assert stdlib["ppl"] == pytest.approx(expected_ppl, abs=1e-4)
    assert document["perplexity"]["overall"]["ppl"] == stdlib["ppl"]
    assert list(stdlib["files"]) == list(STDLIB_FILES) and stdlib["python"].count(".") == 2
    assert "skipped" in document["gsm8k"] and "--gsm8k PATH" in document["gsm8k"]["skipped"]
    assert f"QUALITY ppl source=stdlib ppl={expected_ppl:.4f}" in captured.out
    assert "QUALITY gsm8k skipped: no parquet given" in captured.out


def test_window_nll_rejects_a_misaligned_answer() -> None:
    good = [None, {"7": {"logprob": -0.5}}, {"9": {"logprob": -1.5}}]
    assert window_nll([1, 7, 9], good) == pytest.approx(2.0)
    with pytest.raises(Exception, match="lacks the prompt token 8"):
        window_nll([1, 7, 8], good)
    with pytest.raises(Exception, match="for 3 positions of a 2-token prompt"):
        window_nll([1, 7], good)


def keyword_reply(counts: dict[str, int]) -> str:
    return " ".join(" ".join([f"The {word} glows."] * count) for word, count in counts.items())


GOOD_0 = keyword_reply({"kaleidoscope": 1, "nebula": 2, "whisper": 3, "labyrinth": 5, "paradox": 7})
BAD_1 = keyword_reply({"meridian": 1, "gossamer": 2, "eclipse": 3, "threshold": 5, "cascade": 6})


def test_ifbench_verifiers_score_known_answers() -> None:
    first, second = load_prompts(2)
    assert verify(first, GOOD_0).strict == (True,)
    assert verify(second, BAD_1).strict == (False,) and verify(second, BAD_1).loose == (False,)
    # Loose forgives markdown stars that strict counts against the answer.
    starred = GOOD_0.replace("kaleidoscope", "**kaleidoscope**")
    assert verify(first, starred).loose == (True,)


def test_ifbench_without_nltk_data_names_the_fix() -> None:
    import nltk

    try:
        nltk.data.find("corpora/stopwords")
        pytest.skip("NLTK stopwords are installed here")
    except LookupError:
        pass
    prompt = next(p for p in load_prompts(None) if p["instruction_id_list"] == ["ratio:stop_words"])
    with pytest.raises(IfbenchMissing, match=r"nltk\.downloader .*stopwords"):
        verify(prompt, "The cat sat on the mat with the dog.")


def test_quality_runs_ifbench_and_gsm8k_end_to_end(server, tmp_path, capsys) -> None:
    replies, url = server
    first, second = load_prompts(2)
    replies[first["prompt"]] = GOOD_0
    replies[second["prompt"]] = BAD_1
    parquet = tmp_path / "gsm8k.parquet"
    questions = ["Tom has 3 apples and buys 4. How many?", "What is 10 times 120?"]
    answers = ["3 + 4 = 7\n#### 7", "10 * 120 = 1200\n#### 1,200"]
    pq.write_table(pa.table({"question": questions, "answer": answers}), parquet)
    from hyperqwen.bench.quality_gsm8k import GSM8K_INSTRUCTION

    replies[questions[0] + GSM8K_INSTRUCTION] = "3 + 4 = 7. The answer is 7."
    replies[questions[1] + GSM8K_INSTRUCTION] = "The answer is 1,000."
    out = tmp_path / "q.json"
    code = run_in_process("bench",
        "quality", "--url", url, "--ppl-windows", "0", "--limit", "2",
        "--gsm8k", str(parquet), "--out", str(out),
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(out.read_text())
    ifbench = document["ifbench"]
    assert (ifbench["prompts"], ifbench["instructions"]) == (2, 2)
    assert ifbench["strict_prompt_acc"] == ifbench["loose_instruction_acc"] == 0.5
    assert document["gsm8k"]["accuracy"] == 0.5 and document["gsm8k"]["questions"] == 2
    assert "perplexity" not in document
    assert "QUALITY gsm8k questions=2 accuracy=0.5000" in captured.out


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("So she has 18 eggs. The answer is 18.", "18"),
        ("The total is $1,234.50", "1234.5"),
        ("It drops by -3 degrees", "-3"),
        ("First 5, then 12.00", "12"),
        ("no number here", None),
    ],
)
def test_gsm8k_takes_the_last_number(reply: str, expected: str | None) -> None:
    assert extract_answer(reply) == expected


def test_gsm8k_reference_follows_the_hash_convention() -> None:
    assert reference_answer("He pays 2*3=6\n#### 6") == "6"
    assert reference_answer("#### 1,000") == "1000"
    with pytest.raises(Exception, match="without '####'"):
        reference_answer("just 5")


def result(ppl: float, strict: float, gsm8k: float | None = None) -> dict:
    source = {"ppl": ppl, "fingerprint": "abc", "mean_nll": math.log(ppl)}
    document = {
        "schema": "hyperqwen.bench.quality/1",
        "perplexity": {"sources": {"stdlib": source}, "overall": source},
        "ifbench": {
            "prompts": 10,
            "strict_prompt_acc": strict,
            "strict_instruction_acc": strict,
            "loose_prompt_acc": strict,
            "loose_instruction_acc": strict,
        },
    }
    if gsm8k is not None:
        document["gsm8k"] = {"questions": 50, "accuracy": gsm8k}
    return document


def test_compare_fails_only_past_a_threshold(tmp_path, capsys) -> None:
    def compare(a: dict, b: dict, *options: str) -> int:
        (tmp_path / "a.json").write_text(json.dumps(a))
        (tmp_path / "b.json").write_text(json.dumps(b))
        return run_in_process(
            "bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), *options
        )

    assert compare(result(10.0, 0.50, 0.8), result(10.09, 0.49, 0.79)) == 0
    assert "ppl stdlib: 10.0000 -> 10.0900 (worse by +0.9000 %" in capsys.readouterr().out
    assert compare(result(10.0, 0.50), result(10.11, 0.50)) == 1
    assert "FAIL: ppl stdlib, ppl overall" in capsys.readouterr().err
    assert compare(result(10.0, 0.50, 0.8), result(9.0, 0.60, 0.77)) == 1  # gsm8k -0.03
    assert "gsm8k accuracy" in capsys.readouterr().err
    assert compare(result(10.0, 0.50, 0.8), result(9.0, 0.60, 0.77), "--max-acc-delta", "0.05") == 0
    capsys.readouterr()
    other = result(10.0, 0.5)
    other["perplexity"]["sources"]["stdlib"]["fingerprint"] = "xyz"
    assert compare(result(10.0, 0.5), other) == 2
    assert "not comparable" in capsys.readouterr().err


def test_compare_report_lists_each_metric() -> None:
    lines, failures = compare_documents(result(4.0, 0.9), result(4.0, 0.8), 1.0, 0.02)
    assert failures == [f"ifbench {key}" for key in (
        "strict_prompt_acc", "strict_instruction_acc", "loose_prompt_acc", "loose_instruction_acc"
    )]  # fmt: skip
    assert len(lines) == 6 and lines[0].endswith("ok")


def test_help_teaches_with_examples(capsys) -> None:
    for action in ("quality", "compare", "smollm2"):
        with pytest.raises(SystemExit):
            run_in_process("bench", action, "--help")
        assert "Example" in capsys.readouterr().out
