"""The API patches of the series on the real vLLM OpenAI app (CPU): the key guard
(api-key-deny-by-default, CORS, --root-path, VLLM_API_KEY), the serve flags' help and the
middleware they install.

All test_api_patches*.py files assert on one JSON report of the patched app, built once per
session by tests/api_patches_report.py (how, in its docstring). The body limit, malformed JSON
and unknown-model cases are in test_api_patches_requests.py; the SSE keep-alive, `vllm bench
serve` and stall-sentinel cases in test_api_patches_streams.py. The patches' own classes are
tested in their modules' files: tests/test_engine_body_limit.py and
tests/test_engine_stall_sentinel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from api_patches_app import (
    ALLOWED_ORIGIN,
    GUARDED_SPELLINGS,
    HEADER_TRICKS,
    KEYLESS_PATHS,
    KEYLESS_SPELLINGS,
)


@pytest.fixture
def report(api_patches_report: dict) -> dict:
    """conftest's one report of the patched app, shared by the test_api_patches*.py files."""
    return api_patches_report


def test_vllm_came_from_the_patched_tree(report, patched_vllm):
    assert Path(report["vllm_file"]).is_relative_to(patched_vllm)


def test_every_route_needs_the_key_except_the_keyless_allowlist(report):
    rows = report["routes"]
    paths = {row["path"] for row in rows}
    # The matrix really covers the routes the brief names, the dev routes and the mount.
    for expected in (
        *KEYLESS_PATHS,
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/docs",
        "/openapi.json",
        "/redoc",
        "/invocations",
        "/load",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses/{response_id}",
        "/inference/v1/generate",
        "/server_info",
        "/pause",
        "/collective_rpc",
    ):
        assert expected in paths, f"{expected} is not registered; the matrix missed it"
    assert {row["kind"] for row in rows} <= {"Route", "APIRoute", "Mount"}, (
        "a route of a new kind (WebSocket?) appeared: extend _route_matrix to cover it"
    )
    wrong = []
    for row in rows:
        if row["path"] in KEYLESS_PATHS:
            if row["without_key"] == 401:
                wrong.append(f"{row['method']} {row['path']} is keyless but answered 401")
        elif row["without_key"] != 401 or row["with_key"] == 401:
            wrong.append(
                f"{row['method']} {row['path']}: {row['without_key']} without the key, "
                f"{row['with_key']} with it (want 401, then anything else)"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("target", GUARDED_SPELLINGS)
def test_path_tricks_do_not_reach_a_route_without_the_key(report, target):
    without_key, with_key = report["spellings"][target]
    assert without_key == 401
    assert with_key != 401  # it is the key, not the route, that made the difference


@pytest.mark.parametrize("target", KEYLESS_SPELLINGS)
def test_a_query_string_on_a_keyless_path_stays_keyless(report, target):
    assert report["spellings"][target][0] != 401


@pytest.mark.parametrize("trick", sorted(HEADER_TRICKS))
def test_headers_do_not_stand_in_for_the_key(report, trick):
    assert report["header_tricks"][trick] == 401


def test_the_bearer_scheme_is_case_insensitive_as_before(report):
    assert report["bearer_scheme_any_case"] == 200


def test_cors_preflight_passes_without_the_key_and_nothing_else_does(report):
    cors = report["cors"]
    assert cors["preflight"] == [200, ALLOWED_ORIGIN]
    assert cors["preflight_foreign_origin"] == 400  # CORSMiddleware refuses it, auth did not
    assert cors["bare_options"] == 401
    assert cors["options_origin_only"] == 401
    assert cors["options_method_only"] == 401
    assert cors["simple_request_without_key"] == 401


def test_root_path_keyless_paths_are_exact_below_the_root(report):
    assert report["root_path"] == {
        "/api/version": 200,
        "/api/": 200,
        "/version": 200,  # the router also serves it without the prefix
        "/api/v1/models": 401,
        "/api": 401,
        "/apiv1": 401,
    }


def test_vllm_api_key_from_the_environment_guards_metrics_too(report):
    assert report["env_key"] == {"metrics": 401, "metrics_keyed": 200, "version": 200}


def test_serve_help_teaches_the_new_flags_and_defaults_are_safe(report):
    cli = report["cli"]
    frontend = cli["help"]["Frontend"]
    assert "--sse-keep-alive-interval SSE_KEEP_ALIVE_INTERVAL" in frontend
    assert "--max-request-body-bytes MAX_REQUEST_BODY_BYTES" in frontend
    keep_alive = cli["help"]["sse-keep-alive-interval"]
    # (argparse wraps at hyphens, so the phrases checked here have none)
    assert "which SSE clients ignore" in keep_alive
    assert "0 turns it off" in keep_alive
    assert "(default: 0.0)" in keep_alive
    body_limit = cli["help"]["max-request-body-bytes"]
    assert "answers 413 before any parsing" in body_limit
    assert "(default: 33554432)" in body_limit
    api_key = cli["help"]["api-key"]
    assert "on every route except the liveness probes `/`, `/health`, `/ping` and" in api_key
    assert "any route added later need the key too" in api_key
    assert cli["defaults"] == [0.0, 32 * 1024 * 1024]
    for flag in ("--sse-keep-alive-interval", "--max-request-body-bytes"):
        assert f"{flag} must be >= 0" in cli[f"negative{flag}"]


def test_middleware_follows_the_flags(report):
    middleware = report["cli"]["middleware"]
    names = {case: [name for name, _ in stack] for case, stack in middleware.items()}
    assert ["RequestBodyLimitMiddleware", 32 * 1024 * 1024] in middleware["defaults"]
    assert "SSEKeepAliveMiddleware" not in names["defaults"]  # off unless asked for
    assert ["SSEKeepAliveMiddleware", 2.5] in middleware["keep_alive_on"]
    assert "RequestBodyLimitMiddleware" not in names["body_limit_off"]
    # Both sit inside CORSMiddleware (added before it, so later in the stack).
    order = names["keep_alive_on"]
    assert order.index("CORSMiddleware") < order.index("SSEKeepAliveMiddleware")
    assert order.index("CORSMiddleware") < order.index("RequestBodyLimitMiddleware")
