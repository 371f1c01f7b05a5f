"""`hyperqwen bench soak`: minutes of mixed traffic and faults against a running server, counted.

Workers send a weighted mix of requests until the deadline: streamed and plain chat, plain
completions, tool requests, prompts near the context limit, streams the client drops after a
few chunks and malformed requests; every 60 s a burst of 4 x --slots streamed chats
arrives at once. Every request ends in one outcome:

  ok            a complete answer (a stream ended by [DONE], a JSON body with choices)
  dropped       a stream this client closed on purpose (kind disconnect)
  client_error  HTTP 4xx other than 429 (what malformed requests must get)
  rate_limited  HTTP 429
  server_error  HTTP 5xx, or an error event inside a stream: a clear error
  lost          anything else: a stream cut without [DONE] or error, a body that is not an
                answer, a hang past --timeout, a refused connection. Must be 0.

A valid request that gets a 4xx, or a malformed one that gets an answer, also counts as
`unexpected` (must be 0). The API process's RSS (--api-pid) and the GPU memory of its process
tree (nvidia-smi; the whole GPU's where nvidia-smi does not list those processes, as the report's
gpu_scope says) are sampled after --warmup-s and at the end. Each answered (ok) request's time
from send to its last byte goes into `latency_s`: p50 and p99 per kind and over all kinds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import requests

from hyperqwen.bench.capacity_serve import USAGE_LINE
from hyperqwen.bench.client import CONNECT_TIMEOUT_S, BenchClient, BenchError, SseDecoder
from hyperqwen.bench.header import git_commit, gpu_facts
from hyperqwen.bench.options import DATE_FORMAT, local_server
from hyperqwen.bench.rows import percentile
from hyperqwen.bench.run import served_model
from hyperqwen.checkpoint.shards import atomic_file
from hyperqwen.exit_codes import EXIT_BAD_INPUT
from hyperqwen.settings import SettingsError, load_settings

OUTCOMES = ("ok", "dropped", "client_error", "rate_limited", "server_error", "lost")
# kind -> share of the workers' requests (bursts come on top)
MIX = {
    "chat_stream": 30,
    "chat": 15,
    "completion": 15,
    "tools": 10,
    "long_prompt": 5,
    "disconnect": 15,
    "malformed": 10,
}
EXIT_LOST = 1
BURST_EVERY_S = 60.0
PROGRESS_EVERY_S = 30.0
MAX_TOKENS = 64
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# Each is refused by vLLM's OpenAI server with a 4xx: body not JSON, no messages, a negative
# max_tokens, a model it does not serve.
MALFORMED = ("not json", "no messages", "negative max_tokens", "unknown model")


@dataclass(frozen=True)
class Target:
    base_url: str
    api_key: str | None
    model: str
    max_model_len: int
    timeout_s: float


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def _chat(target: Target, rng: random.Random, **fields) -> dict:
    words = " ".join(rng.choice(("river", "stone", "lamp", "seven", "blue")) for _ in range(12))
    return {
        "model": target.model,
        "messages": [{"role": "user", "content": f"Write about: {words}"}],
        "max_tokens": MAX_TOKENS,
        **fields,
    }


def request_for(kind: str, target: Target, rng: random.Random) -> tuple[str, dict | str]:
    """(path, JSON body or raw text) of one request of this kind."""
    if kind in ("chat_stream", "disconnect", "burst"):
        return "/v1/chat/completions", _chat(target, rng, stream=True)
    if kind == "chat":
        return "/v1/chat/completions", _chat(target, rng)
    if kind == "tools":
        return "/v1/chat/completions", _chat(target, rng, tools=[WEATHER_TOOL], tool_choice="auto")
    if kind in ("completion", "long_prompt"):
        # long_prompt: token ids, so its length is exact (the context limit less the answer)
        length = target.max_model_len - MAX_TOKENS - 8
        prompt = (
            "Once upon a time"
            if kind == "completion"
            else [rng.randrange(100, 1000) for _ in range(length)]
        )
        return "/v1/completions", {
            "model": target.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
        }
    if kind == "malformed":
        flaw = rng.choice(MALFORMED)
        if flaw == "not json":
            return "/v1/chat/completions", '{"model": '
        body = _chat(target, rng)
        if flaw == "no messages":
            del body["messages"]
        elif flaw == "negative max_tokens":
            body["max_tokens"] = -1
        else:
            body["model"] = "no-such-model"
        return "/v1/chat/completions", body
    raise ValueError(kind)


def _read_stream(response: requests.Response, stop_after: int | None) -> str:
    decoder = SseDecoder()
    chunks = 0
    for block in response.iter_content(chunk_size=None):
        for payload in decoder.feed(block):
            if payload == "[DONE]":
                return "ok"
            with contextlib.suppress(json.JSONDecodeError):
                if "error" in json.loads(payload):
                    return "server_error"
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return "dropped"  # leaving the `with` closes the connection mid-stream
    return "lost"  # the server closed the stream without [DONE] or an error


def send(kind: str, target: Target, rng: random.Random) -> str:
    """One request of this kind; its outcome (OUTCOMES)."""
    path, body = request_for(kind, target, rng)
    stream = isinstance(body, dict) and body.get("stream", False)
    payload = {"json": body} if isinstance(body, dict) else {"data": body}
    headers = {**_headers(target), "Content-Type": "application/json"}
    try:
        with requests.post(
            target.base_url + path,
            headers=headers,
            stream=stream,
            timeout=(CONNECT_TIMEOUT_S, target.timeout_s),
            **payload,
        ) as response:
            status = response.status_code
            if status == 429:
                return "rate_limited"
            if 400 <= status < 500:
                return "client_error"
            if status >= 500:
                return "server_error"
            if stream:
                return _read_stream(response, rng.randint(1, 5) if kind == "disconnect" else None)
            try:
                return "ok" if response.json().get("choices") else "lost"
            except (json.JSONDecodeError, AttributeError):
                return "lost"
    except requests.RequestException:
        return "lost"  # refused, reset mid-answer or silent past the timeout


def unexpected(kind: str, outcome: str) -> bool:
    """A malformed request answered, or a valid one refused as the client's fault."""
    if kind == "malformed":
        return outcome in ("ok", "dropped")
    return outcome == "client_error"


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def process_tree(pid: int) -> set[int]:
    """pid and every process below it (the API server's engine core and workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the parent is the 2nd field after the command, which is in parentheses
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        tree.add(current)
        todo.extend(children.get(current, []))
    return tree


def _nvidia_smi(query: str) -> list[list[str]]:
    """Rows of `nvidia-smi --query-...=... --format=csv,noheader,nounits`; [] without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line]


def gpu_memory(api_pid: int | None) -> dict:
    """GPU memory the server holds: summed over its processes where nvidia-smi lists them
    (so two servers can soak side by side on one GPU), else the first GPU's whole use (a
    container's own PIDs need not be the ones nvidia-smi shows); None without nvidia-smi."""
    tree = process_tree(api_pid) if api_pid is not None else set()
    used = [
        float(row[1])
        for row in _nvidia_smi("--query-compute-apps=pid,used_memory")
        if len(row) == 2 and row[0].isdigit() and int(row[0]) in tree
    ]
    if used:
        return {"gpu_used_mib": sum(used), "gpu_scope": "server processes"}
    whole = _nvidia_smi("--query-gpu=memory.used")
    try:
        return {"gpu_used_mib": float(whole[0][0]), "gpu_scope": "whole GPU"}
    except (IndexError, ValueError):
        return {"gpu_used_mib": None, "gpu_scope": None}


def profiled_activation_mib(server_log: str) -> float | None:
    """The activation peak vLLM's memory profile measured and kept out of the KV pool, from the
    server's usage line (capacity_serve.USAGE_LINE; the last start's); None where the log has
    none. vLLM empties PyTorch's cache after the profile, so traffic may take up to this much
    back without a leak: the GPU memory growth a soak may show before it is one."""
    found = USAGE_LINE.findall(server_log)
    return float(found[-1][1]) * 1024 if found else None


class Tally:
    """Outcome counts per kind, shared by the worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, Counter] = {}
        self.unexpected: Counter = Counter()
        self.answer_s: dict[str, list[float]] = {}

    def add(self, kind: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self.counts.setdefault(kind, Counter())[outcome] += 1
            if unexpected(kind, outcome):
                self.unexpected[kind] += 1
            if outcome == "ok":
                self.answer_s.setdefault(kind, []).append(seconds)

    def latency(self) -> dict[str, dict]:
        """p50 and p99 of the answered requests' seconds, per kind and over all ("all")."""
        with self._lock:
            groups = {**self.answer_s, "all": [s for kind in self.answer_s.values() for s in kind]}
        return {
            kind: {
                "n": len(seconds),
                "p50": round(percentile(seconds, 50), 3),
                "p99": round(percentile(seconds, 99), 3),
            }
            for kind, seconds in sorted(groups.items())
            if seconds
        }

    def total(self, outcome: str) -> int:
        with self._lock:
            return sum(counter[outcome] for counter in self.counts.values())

    def line(self) -> str:
        with self._lock:
            sent = sum(sum(counter.values()) for counter in self.counts.values())
        shown = ", ".join(f"{name} {self.total(name)}" for name in OUTCOMES)
        return f"{sent} requests: {shown}"


def soak(
    target: Target,
    duration_s: float,
    concurrency: int,
    slots: int,
    warmup_s: float,
    api_pid: int | None,
    seed: int = 0,
    burst_every_s: float = BURST_EVERY_S,
    sample_every_s: float = PROGRESS_EVERY_S,
) -> dict:
    """Run the traffic; the report (see the module docstring)."""
    tally = Tally()
    first_burst_answered = threading.Event()
    start = time.monotonic()
    deadline = start + duration_s
    kinds, weights = zip(*MIX.items(), strict=True)

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            timed_send(kind, rng)

    def timed_send(kind: str, rng: random.Random) -> None:
        sent = time.monotonic()
        outcome = send(kind, target, rng)
        tally.add(kind, outcome, time.monotonic() - sent)

    def one_burst_request(rng: random.Random) -> None:
        timed_send("burst", rng)

    def bursts() -> None:
        rng = random.Random(seed * 1000 - 1)
        while time.monotonic() + burst_every_s < deadline:
            time.sleep(burst_every_s)
            burst = [
                threading.Thread(target=one_burst_request, args=(random.Random(rng.random()),))
                for _ in range(4 * slots)
            ]
            for thread in burst:
                thread.start()
            for thread in burst:
                thread.join()
            first_burst_answered.set()
        first_burst_answered.set()  # none (more) fits before the deadline

    def memory(at: float) -> dict:
        return {
            "at_s": round(at - start, 1),
            "api_rss_mib": rss_mib(api_pid),
            **gpu_memory(api_pid),
        }

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    threads.append(threading.Thread(target=bursts, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(min(warmup_s, duration_s))
    first_burst_answered.wait(max(deadline - time.monotonic(), 0))
    memory_start = memory(time.monotonic())
    samples = [memory_start]
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    next_sample = time.monotonic() + sample_every_s
    while any(thread.is_alive() for thread in threads):
        time.sleep(0.5)
        now = time.monotonic()
        if now >= next_progress:
            print(f"  {now - start:.0f} s: {tally.line()}", flush=True)
            next_progress += PROGRESS_EVERY_S
        if now >= next_sample:
            samples.append(memory(now))
            next_sample += sample_every_s
    memory_end = memory(time.monotonic())
    samples.append(memory_end)
    return {
        "duration_s": round(time.monotonic() - start, 1),
        "concurrency": concurrency,
        "slots": slots,
        "mix": MIX,
        "burst": {"every_s": burst_every_s, "requests": 4 * slots},
        "outcomes": {kind: dict(counter) for kind, counter in sorted(tally.counts.items())},
        "totals": {name: tally.total(name) for name in OUTCOMES},
        "unexpected": dict(tally.unexpected),
        "latency_s": tally.latency(),
        "memory_after_warmup": memory_start,
        "memory_at_end": memory_end,
        "memory_samples": samples,
    }


def cmd_soak(args: argparse.Namespace) -> int:
    try:
        loaded = load_settings(env_file=Path(args.env_file) if args.env_file else None)
    except SettingsError as error:
        print(f"hyperqwen bench soak: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    url, api_key = local_server(loaded, args.url)
    try:
        model, max_model_len = served_model(BenchClient(url, api_key, args.timeout), args.model)
    except (BenchError, requests.RequestException) as error:
        print(f"hyperqwen bench soak: {url}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not max_model_len or max_model_len <= MAX_TOKENS + 16:
        print(f"hyperqwen bench soak: {model} has max_model_len {max_model_len}", file=sys.stderr)
        return EXIT_BAD_INPUT
    target = Target(url, api_key, model, max_model_len, args.timeout)
    concurrency = args.concurrency or 2 * args.slots
    print(
        f"soak {url} ({model}): {args.minutes:g} min, {concurrency} workers, "
        f"bursts of {4 * args.slots} every {BURST_EVERY_S:g} s",
        flush=True,
    )
    report = soak(
        target, args.minutes * 60, concurrency, args.slots, args.warmup_s, args.api_pid, args.seed
    )
    report.update(
        url=url,
        model=model,
        date=time.strftime(DATE_FORMAT),
        commit=git_commit(),
        gpu=gpu_facts(),
        command=shlex.join(soak_command(args, url)),
    )
    lost, odd = report["totals"]["lost"], sum(report["unexpected"].values())
    print(f"done: {sum(report['totals'].values())} requests; lost {lost}, unexpected {odd}")
    start, end = report["memory_after_warmup"], report["memory_at_end"]
    print(f"memory after warm-up {start}, at the end {end}")
    if overall := report["latency_s"].get("all"):
        print(f"answered in {overall['p50']} s (p50), {overall['p99']} s (p99)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out) as partial:
            partial.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return EXIT_LOST if lost or odd else 0


def soak_command(args: argparse.Namespace, url: str) -> list[str]:
    """The command that repeats this soak, every default spelled out (the key left out)."""
    command = ["hyperqwen", "bench", "soak", "--url", url, "--minutes", f"{args.minutes:g}"]
    command += [
        "--slots",
        str(args.slots),
        "--concurrency",
        str(args.concurrency or 2 * args.slots),
    ]
    command += ["--warmup-s", f"{args.warmup_s:g}", "--timeout", f"{args.timeout:g}"]
    command += ["--seed", str(args.seed)] + (["--model", args.model] if args.model else [])
    return command


def add_subcommand(actions) -> None:
    soak = actions.add_parser(
        "soak",
        help="minutes of mixed traffic and faults against a running server, every request counted",
        description=(__doc__ or "").split("\n\n", 1)[-1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The key is the server's own (VLLM_API_KEY or API_KEY_FILE, from the environment "
        "or .env).\nExample:\n  hyperqwen bench soak --minutes 10 --slots 4 "
        "--api-pid $(pgrep -of 'vllm serve') --out soak.json\n"
        "Exit codes: 0 nothing lost, 1 a request lost or unexpected, 2 the server cannot be asked.",
    )
    soak.add_argument("--url", help="the server, no /v1 (default http://127.0.0.1:PORT)")
    soak.add_argument("--model", help="the model to ask (default: the first one served)")
    soak.add_argument("--env-file", metavar="FILE", help="knobs (default ./.env): PORT, the key")
    soak.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    soak.add_argument(
        "--slots", type=int, default=4, help="the server's MAX_SEQS (default 4); bursts are 4x it"
    )
    soak.add_argument(
        "--concurrency", type=int, default=0, help="worker threads (default 2 x --slots)"
    )
    soak.add_argument(
        "--warmup-s", type=float, default=30.0, help="seconds before the first memory sample"
    )
    soak.add_argument("--api-pid", type=int, help="the API server's pid, whose RSS is sampled")
    soak.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds of silence after which a request counts as lost (default 120)",
    )
    soak.add_argument("--seed", type=int, default=0, help="seed of the mix (default 0)")
    soak.add_argument("--out", metavar="PATH", help="report JSON")
    soak.set_defaults(func=cmd_soak)
