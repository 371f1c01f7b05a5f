"""Draft-vocabulary rankings: the shipped default, cutting a vocabulary, the ShareGPT builder, and
`hyperqwen drafter recount` against a real HTTP server (a small FastAPI app served by uvicorn
on a local port, answering like vLLM's OpenAI API), feeding `hyperqwen prepare --draft-vocab`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations
from fastapi.responses import JSONResponse
from local_server import free_port, serving
from test_prepare_common import prepare_copy, run_prepare, tiny_base_dir

from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS, TOKENIZER_SIZE
from hyperqwen.drafter import vocab
from hyperqwen.drafter.cli import add_subcommand
from hyperqwen.drafter.recount import TOKEN_ID_PREFIX
from hyperqwen.prepare import folder

KEY = "sk-drafter-test"


def drafter(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hyperqwen")
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["drafter", *argv])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = args.func(args)
    return code, stdout.getvalue(), stderr.getvalue()


# --- rankings and cuts ---------------------------------------------------------------------


def test_the_shipped_ranking_is_real_and_says_how_it_was_made():
    ranked = vocab.read_ranking(vocab.DEFAULT_RANKING)
    assert len(ranked) == 65_536 == len(set(ranked))
    assert all(0 <= token_id < TOKENIZER_SIZE for token_id in ranked)
    header = vocab.DEFAULT_RANKING.read_text().split("\n# Made by")[0]
    assert "ShareGPT V3" in header and "Qwen3.5" in header
    coverage = float(re.search(r"size  40960: ([\d.]+)% of held-out", header).group(1))
    assert 95 < coverage < 100
    # the most frequent ids are what English chat text is made of
    from hyperqwen.checkpoint.tokenizer import build_fast_tokenizer

    tokenizer = build_fast_tokenizer()
    top = {tokenizer.decode([token_id]) for token_id in ranked[:20]}
    assert {" the", ",", "."} <= top


def test_cut_puts_special_tokens_first_and_sorts():
    ranked = [500, 7, 500_000 % TOKENIZER_SIZE, 9, 3]
    specials = sorted(SPECIAL_TOKEN_IDS.values())
    chosen = vocab.cut(ranked, len(specials) + 3, TOKENIZER_SIZE)
    assert chosen == sorted([*specials, 500, 7, 500_000 % TOKENIZER_SIZE])
    with pytest.raises(vocab.VocabError, match="lower --draft-size"):
        vocab.cut(ranked, len(specials) + 10, TOKENIZER_SIZE)
    with pytest.raises(vocab.VocabError, match="outside the vocabulary"):
        vocab.cut([TOKENIZER_SIZE + 5], len(specials) + 1, TOKENIZER_SIZE)


def test_rankings_are_read_strictly(tmp_path):
    path = tmp_path / "ranking.txt"
    vocab.write_ranking(path, [5, 3, 9], ["made by hand", ""])
    assert path.read_text().startswith("# made by hand\n#\n5\n")
    assert vocab.read_ranking(path) == [5, 3, 9]
    path.write_text("5\nthree\n")
    with pytest.raises(vocab.VocabError, match=r"ranking.txt:2: 'three' is not a token id"):
        vocab.read_ranking(path)
    path.write_text("5\n5\n")
    with pytest.raises(vocab.VocabError, match="listed twice"):
        vocab.read_ranking(path)


def test_sharegpt_builder_tokenizes_real_assistant_text(tmp_path):
    out = tmp_path / "ranking.txt"
    code, stdout, _ = drafter("sharegpt", "--limit", "300", "--keep", "50000", "--out", str(out))
    assert code == 0
    assert re.search(r"counted \d+ tokens of \d+ assistant turns", stdout)
    ranked = vocab.read_ranking(out)
    assert 5_000 < len(ranked) <= 50_000
    assert "300 conversations" in out.read_text()
    assert "Made by: hyperqwen drafter sharegpt --limit 300" in out.read_text()


# --- recount against a real server ---------------------------------------------------------


def _generated(messages: list[dict], max_tokens: int) -> list[int]:
    """What the test server 'generates': ids derived from the prompt, deterministically."""
    text = messages[-1]["content"]
    return [1000 + ord(char) for char in text][:max_tokens]


def _openai_app(requests_seen: list[dict]) -> FastAPI:
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if not authorized(request):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        body = await request.json()
        requests_seen.append(body)
        ids = _generated(body["messages"], body["max_tokens"])
        text = "".join(chr(token_id - 1000) for token_id in ids)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        # "plain" stands for a server that returns no logprobs: recount must /tokenize instead.
        if body["model"] != "plain" and body.get("return_tokens_as_token_ids"):
            choice["logprobs"] = {
                "content": [
                    {"token": f"{TOKEN_ID_PREFIX}{token_id}", "logprob": -0.1} for token_id in ids
                ]
            }
        return {"object": "chat.completion", "model": body["model"], "choices": [choice]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        tokens = [1000 + ord(char) for char in body["prompt"]]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    return app


@pytest.fixture(scope="module")
def server():
    seen: list[dict] = []
    with serving(_openai_app(seen)) as port:
        yield f"http://127.0.0.1:{port}", seen


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "aaab"},
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "aab"}]},
        {"prompt": "ac"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_recount_ranks_the_token_ids_the_server_generates(server, prompts, tmp_path):
    url, seen = server
    out = tmp_path / "ranking.txt"
    code, stdout, err = drafter(
        "recount", "--prompts", str(prompts), "--out", str(out), "--url", url,
        "--api-key", KEY, "--quiet", "--concurrency", "2",
    )  # fmt: skip
    assert code == 0, err
    assert "3 responses, 9 tokens, 3 distinct ids" in stdout
    request = seen[-1]
    assert request["model"] == "tiny"  # the first model /v1/models lists
    assert request["logprobs"] is True and request["return_tokens_as_token_ids"] is True
    ranked = vocab.read_ranking(out)
    a, b, c = 1000 + ord("a"), 1000 + ord("b"), 1000 + ord("c")
    assert ranked[:3] == [a, b, c]  # 6 a, 2 b, 1 c
    base = vocab.read_ranking(vocab.DEFAULT_RANKING)
    assert ranked[3:] == [token_id for token_id in base if token_id not in (a, b, c)]
    assert "hyperqwen prepare --draft-vocab" in out.read_text()


def test_recount_tokenizes_the_text_when_the_server_gives_no_logprobs(server, prompts, tmp_path):
    url, _ = server
    out = tmp_path / "ranking.txt"
    code, _, err = drafter(
        "recount", "--prompts", str(prompts), "--out", str(out), "--url", url,
        "--api-key", KEY, "--model", "plain", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert vocab.read_ranking(out)[:3] == [1000 + ord("a"), 1000 + ord("b"), 1000 + ord("c")]


def test_recount_says_what_is_wrong_with_the_server(server, prompts, tmp_path):
    url, _ = server
    out = tmp_path / "ranking.txt"
    code, _, err = drafter("recount", "--prompts", str(prompts), "--out", str(out), "--url", url)
    assert code == 2 and "wants an API key: set VLLM_API_KEY or --api-key" in err
    closed = f"http://127.0.0.1:{free_port()}"
    code, _, err = drafter("recount", "--prompts", str(prompts), "--out", str(out), "--url", closed)
    assert code == 2 and f"no server answers at {closed}" in err
    assert not out.exists()


def test_a_recounted_ranking_recuts_the_draft_vocabulary_of_a_prepared_model(
    server, prompts, tmp_path, tmp_path_factory
):
    url, _ = server
    ranking = tmp_path / "ranking.txt"
    code, _, err = drafter(
        "recount", "--prompts", str(prompts), "--out", str(ranking), "--url", url,
        "--api-key", KEY, "--quiet",
    )  # fmt: skip
    assert code == 0, err
    model = prepare_copy(tiny_base_dir(tmp_path_factory), tmp_path / "model")
    code, out, err = run_prepare(str(model), "--quiet", "--draft-vocab", str(ranking))
    assert code == 0, err
    assert re.search(r"draft vocabulary \(40960 ids\).*\s+done:", out)
    assert re.search(r"lm_head -> int8.*already done", out)  # nothing else was redone
    ids = [
        int(line)
        for line in (model / folder.DRAFT_IDS_FILE).read_text().splitlines()
        if not line.startswith("#")
    ]
    assert {1000 + ord("a"), 1000 + ord("b"), 1000 + ord("c")} <= set(ids)
    assert ids == vocab.cut(vocab.read_ranking(ranking), 40_960, TOKENIZER_SIZE)
    assert (model / folder.DRAFT_RANKING_FILE).read_bytes() == ranking.read_bytes()
    code, out, _ = run_prepare(str(model))  # the recounted ranking is kept: nothing to do
    assert code == 0 and "already prepared" in out
    counts = Counter(vocab.read_ranking(ranking)[:3])
    assert vocab.coverage(ids, counts) == 1.0
