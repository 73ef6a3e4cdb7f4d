"""`specdec serve` under load: N concurrent clients vs the same requests one at a time,
speculation on and off.

Starts `specdec serve` (the CLI as documented: bundled demo pair by default, its
defaults otherwise), waits until every replica is ready, warms it up (each prompt
alone, then two rounds of all clients at once, so that the programs each batch
size needs are compiled), then sends the same requests twice: one at a time, and
from `--clients` concurrent clients (`--requests` each, back to back).
Prints throughput (output tokens/s) for both, their ratio, and the p50 / p99
request latency of the concurrent run; then the same with `--method none`
(speculation off). Greedy, so both runs must return the same texts (checked).

Ray must stay on loopback, so run it in its own network namespace (as root):

    unshare -n sh -c 'ip link set lo up; exec python benchmarks/bench_serve.py'
    unshare -n sh -c 'ip link set lo up; exec python benchmarks/bench_serve.py \\
        --clients 32 --requests 4 --max-tokens 64 --json serve.json'
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import DEMO, describe_machine, heldout_prompts, machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, method: str, log: Path):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))  # fmt: skip
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model,
           "--port", str(port), "--num-replicas", str(args.replicas),
           "--served-model-name", "bench"]  # fmt: skip
    if method == "none":
        cmd += ["--method", "none"]
    elif args.draft:
        cmd += ["--draft", args.draft]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline, streak = time.monotonic() + 900, 0
    while streak < 4 * args.replicas:  # every replica answers 200
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"specdec serve did not start:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                streak = streak + 1 if r.status == 200 else 0
        except (urllib.error.URLError, OSError):
            streak = 0
        time.sleep(0.25 if streak else 2)
    return proc, base


def stop(proc) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def complete(base: str, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """(text, output tokens, seconds) of one greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"], out["usage"]["completion_tokens"], time.perf_counter() - t


def run_mode(args, method: str, prompts: list[str]) -> dict:
    log = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "serve.log"
    proc, base = start(args, method, log)
    try:
        # Warm-up: the programs each prompt length and each batch size needs compile on
        # first use; one request at a time, then two concurrent rounds, before timing.
        for p in prompts[: args.clients]:
            complete(base, p, args.max_tokens)
        for _ in range(2):
            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(lambda p: complete(base, p, args.max_tokens),
                              prompts[: args.clients]))  # fmt: skip
        t = time.perf_counter()
        alone = [complete(base, p, args.max_tokens) for p in prompts]
        alone_s = time.perf_counter() - t

        def client(c: int):
            return [complete(base, prompts[c * args.requests + j], args.max_tokens)
                    for j in range(args.requests)]  # fmt: skip

        t = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            together = [r for rs in pool.map(client, range(args.clients)) for r in rs]
        together_s = time.perf_counter() - t
    finally:
        stop(proc)
    same = [a[0] for a in alone] == [b[0] for b in together]
    tokens = sum(r[1] for r in together)
    lat = sorted(r[2] for r in together)
    result = {
        "method": method,
        "requests": len(prompts),
        "output_tokens": tokens,
        "one_at_a_time_tok_s": sum(r[1] for r in alone) / alone_s,
        "concurrent_tok_s": tokens / together_s,
        "p50_latency_s": statistics.median(lat),
        "p99_latency_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "same_texts": same,
    }
    result["ratio"] = result["concurrent_tok_s"] / result["one_at_a_time_tok_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=None, help="default: the CLI's (bundled draft)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--lines", type=int, default=12, help="held-out lines per prompt")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    n = args.clients * args.requests
    base_prompts = heldout_prompts(lines=args.lines)
    prompts = [base_prompts[i % len(base_prompts)] for i in range(n)]
    print(describe_machine())
    print(f"{args.clients} clients x {args.requests} requests, {args.max_tokens} tokens each "
          f"(greedy), {args.replicas} replica(s), model {args.model}")  # fmt: skip
    results = []
    for method in ("auto", "none"):
        r = run_mode(args, method, prompts)
        results.append(r)
        label = "speculation on " if method == "auto" else "speculation off"
        print(f"{label}: concurrent {r['concurrent_tok_s']:7.1f} tok/s vs one at a time "
              f"{r['one_at_a_time_tok_s']:6.1f} tok/s = {r['ratio']:.2f}x; latency p50 "
              f"{r['p50_latency_s']:.2f} s, p99 {r['p99_latency_s']:.2f} s; same texts: "
              f"{r['same_texts']}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results},
                                              indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
