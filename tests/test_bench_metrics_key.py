"""bench-metrics-api-key: `vllm bench serve` sends its key on the /metrics scrapes (CPU).

The whole series is applied to a pristine vLLM unpacked from the pinned wheel. One subprocess
(this file run as a script, the patched tree first on sys.path) serves tests/openai_test_server.py's
app (spec-decode counters from synthetic acceptance) behind the patched tree's own
AuthenticationMiddleware with --api-key, so /metrics needs the key as on a HyperQwen server.
Against it, it calls the patched fetch_spec_decode_metrics / fetch_diffusion_metrics with the
key from OPENAI_API_KEY, from headers, with a wrong key and with none, and runs the real
`vllm bench serve` CLI of the patched and of the pristine tree with OPENAI_API_KEY set, then
writes one JSON report. The tests below assert on that report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import process_group
import pytest

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-hyperqwen-bench"
# What a client would print had it said why the metrics were missing
UNAUTHORIZED = re.compile(r"unauthori[sz]ed|\b(?:http|status|error|code)\W{0,3}401\b", re.I)
PATCH = "bench-metrics-api-key.patch"
MODEL = "tiny"
NUM_PROMPTS = 4
OUTPUT_LEN = 8
# One draft per step, accepted every other step (the test server spreads 0.5 evenly): each
# 8-token request takes 5 verify steps after its first token and accepts 2 drafts.
SPEC_CONFIG = {"method": "mtp", "num_speculative_tokens": 1, "synthetic_acceptance_rates": [0.5]}
DRAFTS_PER_REQUEST, ACCEPTED_PER_REQUEST = 5, 2
REFUSAL = (
    "WARNING: the metrics endpoint {url} {reason} (HTTP 401): "
    "speculative decoding acceptance and diffusion figures are omitted."
)
KEY_REFUSED = "refused the API key"
NO_KEY = (
    "needs an API key and none was sent (set OPENAI_API_KEY or --header 'Authorization=Bearer KEY')"
)


# --- runs in the subprocess -------------------------------------------------------------------
# `python tests/test_bench_metrics_key.py PATCHED_PARENT PRISTINE_PARENT CHECKPOINT REPORT`


def _drive(patched_parent: str, pristine_parent: str, checkpoint: str, workdir: Path) -> dict:
    sys.path.insert(0, patched_parent)
    import vllm
    from local_server import serving

    report: dict = {"vllm_file": vllm.__file__}
    with serving(_keyed_app(workdir), log_level="critical") as port:
        base_url = f"http://127.0.0.1:{port}"
        report["base_url"] = base_url
        report["scrapes"] = _scrape_checks(base_url)
        report["bench"] = {
            tree: _bench_serve(parent, base_url, checkpoint, workdir / tree)
            for tree, parent in (("patched", patched_parent), ("pristine", pristine_parent))
        }
        report["bench_asking_model"] = {
            tree: _bench_serve(parent, base_url, checkpoint, workdir / f"{tree}-ask", True)
            for tree, parent in (("patched", patched_parent), ("pristine", pristine_parent))
        }
    return report


def _keyed_app(workdir: Path):
    """openai_test_server's app behind the patched vLLM's --api-key middleware."""
    import openai_test_server
    from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware

    config = workdir / "fake-config.json"
    timing = {"startup_s": 0, "weight_gib": 0, "prefill_ms": 1, "step_ms": 1}
    config.write_text(json.dumps({"patched": timing}))
    args, behaviour = openai_test_server.parse_args(
        ["--fake-config", str(config), "--side", "patched", "serve", MODEL, "--port", "0",
         "--speculative-config", json.dumps(SPEC_CONFIG)]
    )  # fmt: skip
    app = openai_test_server.build_app(args, behaviour)
    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])
    return app


def _scrape_checks(base_url: str) -> dict:
    """The patched scrape functions under each way of sending (or not sending) the key."""
    import asyncio
    import contextlib
    import io

    import aiohttp
    from vllm.benchmarks import serve

    async def scrape(fetch, extra_headers) -> dict | None:
        async with aiohttp.ClientSession() as session:
            found = await fetch(base_url, session, extra_headers)
        return None if found is None else vars(found)

    def case(env_key: str | None, extra_headers: dict | None = None, times: int = 1) -> dict:
        os.environ.pop("OPENAI_API_KEY", None)
        if env_key is not None:
            os.environ["OPENAI_API_KEY"] = env_key
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            results = [
                asyncio.run(scrape(fetch, extra_headers))
                for _ in range(times)
                for fetch in (serve.fetch_spec_decode_metrics, serve.fetch_diffusion_metrics)
            ]
        return {"spec": results[0], "results": results, "printed": printed.getvalue()}

    return {
        "env_key": case(KEY),
        "header_key": case(None, {"Authorization": f"Bearer {KEY}"}),
        "header_over_env": case("not-the-key", {"Authorization": f"Bearer {KEY}"}),
        "wrong_key": case("not-the-key", times=2),
        "no_key": case(None, times=2),
    }


def _bench_serve(
    parent: str, base_url: str, checkpoint: str, result_dir: Path, ask_model: bool = False
) -> dict:
    """The real `vllm bench serve` of the tree at parent, with OPENAI_API_KEY set; with
    `ask_model` no --model, so it asks the server's /v1/models for it."""
    result_dir.mkdir()
    model = [] if ask_model else ["--model", MODEL]
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--base-url", base_url, *model, "--tokenizer", checkpoint,
        "--dataset-name", "random", "--random-input-len", "16",
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
        "--result-filename", "result.json",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": parent,
        "PYTHONDONTWRITEBYTECODE": "1",  # the pristine tree is read-only
        "OPENAI_API_KEY": KEY,
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=env, cwd=result_dir
    )
    result_file = result_dir / "result.json"
    return {
        "returncode": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr[-4000:],
        "result": json.loads(result_file.read_text()) if result_file.exists() else None,
    }


# --- pytest -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(
    patched_vllm: Path, pristine_vllm_dir: Path, tiny_checkpoint: Path, tmp_path_factory
) -> dict:
    workdir = tmp_path_factory.mktemp("bench-key-report")
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_API_KEY": "",
        "PYTHONPATH": str(ROOT / "src"),  # vllm comes from argv[1]
    }
    trees_and_files = (patched_vllm.parent, pristine_vllm_dir.parent, tiny_checkpoint, workdir)
    done = process_group.run(  # the driver runs `vllm bench serve` as its own child
        [sys.executable, __file__, *map(str, trees_and_files)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=workdir,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((workdir / "report.json").read_text())


def test_the_patch_applies_and_verifies_on_a_pristine_tree(vllm_tree_copy):
    from hyperqwen.patches.series import load_series
    from hyperqwen.patches.tree import apply_series

    series = load_series(ROOT / "patches")
    (patch,) = [p for p in series.patches if p.name == PATCH]
    assert patch.kind == "fix" and patch.upstream == "none"
    assert patch.touched_paths == ("benchmarks/serve.py",)
    apply_series(series, vllm_tree_copy)
    done = subprocess.run(
        [sys.executable, "-m", "hyperqwen.cli", "patches", "verify", str(vllm_tree_copy)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"applied     {PATCH}" in done.stdout.splitlines()


def test_vllm_came_from_the_patched_tree(report, patched_vllm):
    assert Path(report["vllm_file"]).is_relative_to(patched_vllm)


@pytest.mark.parametrize("case", ["env_key", "header_key", "header_over_env"])
def test_the_scrape_sends_the_requests_key_and_reads_the_counters(report, case):
    scraped = report["scrapes"][case]
    assert scraped["spec"] is not None, scraped
    assert set(scraped["spec"]) == {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "accepted_per_pos",
    }
    assert scraped["printed"] == ""


@pytest.mark.parametrize(("case", "reason"), [("wrong_key", KEY_REFUSED), ("no_key", NO_KEY)])
def test_a_refused_scrape_says_so_once_and_omits_the_figures(report, case, reason):
    scraped = report["scrapes"][case]
    assert scraped["results"] == [None] * 4  # spec decode and diffusion, twice each
    url = f"{report['base_url']}/metrics"
    assert scraped["printed"].splitlines() == [REFUSAL.format(url=url, reason=reason)]


def test_vllm_bench_serve_reports_acceptance_against_a_keyed_server(report):
    bench = report["bench"]["patched"]
    assert bench["returncode"] == 0, bench["stderr"]
    result = bench["result"]
    assert result["completed"] == NUM_PROMPTS
    assert result["spec_decode_num_drafts"] == NUM_PROMPTS * DRAFTS_PER_REQUEST
    assert result["spec_decode_accepted_tokens"] == NUM_PROMPTS * ACCEPTED_PER_REQUEST
    assert result["spec_decode_acceptance_rate"] == pytest.approx(
        100 * ACCEPTED_PER_REQUEST / DRAFTS_PER_REQUEST
    )
    assert "Speculative Decoding" in bench["stdout"]
    assert "Acceptance rate (%):" in bench["stdout"]
    assert "WARNING: the metrics endpoint" not in bench["stdout"]


def test_stock_vllm_bench_serve_silently_omits_acceptance_against_a_keyed_server(report):
    """What the patch fixes: when this fails, stock sends the key and the patch can retire."""
    bench = report["bench"]["pristine"]
    assert bench["returncode"] == 0, bench["stderr"]
    assert bench["result"]["completed"] == NUM_PROMPTS
    assert not any(name.startswith("spec_decode") for name in bench["result"])
    assert "Speculative Decoding" not in bench["stdout"]
    # and nothing says why (a bare "401" can be part of a figure, e.g. "1401.01" tok/s)
    assert not UNAUTHORIZED.search(bench["stdout"])


def test_without_model_the_lookup_sends_the_key_too(report):
    patched, pristine = (report["bench_asking_model"][tree] for tree in ("patched", "pristine"))
    assert patched["returncode"] == 0, patched["stderr"]
    assert patched["result"]["completed"] == NUM_PROMPTS
    assert f"First model name: {MODEL}" in patched["stdout"]
    # stock asks /v1/models without the key and stops before the run (what the patch fixes)
    assert pristine["returncode"] != 0 and pristine["result"] is None
    assert "Failed to fetch models" in pristine["stderr"] + pristine["stdout"]


if __name__ == "__main__":
    workdir = Path(sys.argv[4])
    result = _drive(sys.argv[1], sys.argv[2], sys.argv[3], workdir)
    (workdir / "report.json").write_text(json.dumps(result))
