"""The OpenAI-compatible server against the engine in this process, side by side in one run.

`python -m engine serve` runs in a subprocess (what a user starts); the official `openai` client streams from it.
The same model runs in this process through a ChatSession. Both read the same prompt (a real speech excerpt and a
question), greedy, the same number of new tokens with EOS ignored; runs alternate (engine, server, engine, ...) so
the machine's noise falls on both. Reported, as medians and ratios:

- TTFT and decode tok/s, in-process vs through the server (the added latency of HTTP, JSON and the event stream);
- the second turn of a conversation: the prompt tokens the server reads (the client resends the whole
  conversation; the server reuses its cache) against a chat session's;
- a load test: N requests from C concurrent clients (short replies): throughput, latency p50 / p95, how many were
  answered 429, none 500, and the server's RSS before and after.

Usage: python -m benchmarks.serve [--words 400] [--new-tokens 64] [--runs 5] [--requests 200] [--clients 8]
Writes results/serve/serve.json, serve.md and serve.png.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import psutil

from engine import DSV41Config, DSV41Model
from engine.config import USER_DEFAULTS
from engine.events import Done, TokenText

from .common import machine, write_results
from .corpus import speech

QUESTION = "What does the speech say about the economy? Answer in a few sentences."
FOLLOW_UP = "And what does it say about education?"


def prompt_of(words: int) -> str:
    text = " ".join(speech("2013-Obama-1").split()[:words])
    return f"{text}\n\n{QUESTION}"


def in_process(model, prompt: str, new_tokens: int) -> dict:
    session = model.chat_session()
    started = time.perf_counter()
    first = last = None
    done = None
    for event in session.send(prompt, max_new_tokens=new_tokens, greedy=True, ignore_eos=True):
        if isinstance(event, TokenText) and event.text:
            now = time.perf_counter()
            first = first or now
            last = now
        elif isinstance(event, Done):
            done = event
    stats = done.stats
    return {"ttft_s": first - started, "decode_tok_s": (stats.decode_tokens - 1) / (last - first),
            "completion_tokens": stats.decode_tokens, "text": done.text}


def through_server(client, prompt: str, new_tokens: int) -> dict:
    started = time.perf_counter()
    first = last = None
    usage = None
    parts = []
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}], max_tokens=new_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            parts.append(chunk.choices[0].delta.content)
    return {"ttft_s": first - started, "decode_tok_s": (usage.completion_tokens - 1) / (last - first),
            "completion_tokens": usage.completion_tokens, "text": "".join(parts)}


def second_turn(model, client, prompt: str) -> dict:
    """Prompt tokens read by the second turn of one conversation: a chat session vs the server."""
    session = model.chat_session()
    first = [e for e in session.send(prompt, max_new_tokens=16, greedy=True) if isinstance(e, Done)][0]
    second = [e for e in session.send(FOLLOW_UP, max_new_tokens=16, greedy=True) if isinstance(e, Done)][0]
    messages = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                           temperature=0)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": FOLLOW_UP}]
    started = time.perf_counter()
    again = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                           temperature=0)
    server_s = time.perf_counter() - started
    return {"session_first_prompt_tokens": first.stats.prefill_tokens,
            "session_second_prompt_tokens": second.stats.prefill_tokens,
            "server_first_prompt_tokens": reply.usage.prompt_tokens,
            "server_second_prompt_tokens": again.usage.prompt_tokens,
            "session_second_ttft_s": second.stats.ttft_s, "server_second_total_s": server_s,
            "texts": [first.text, reply.choices[0].message.content, second.text, again.choices[0].message.content],
            "same_replies": (first.text == reply.choices[0].message.content
                             and second.text == again.choices[0].message.content)}


def load_test(client, server: psutil.Process, requests: int, clients: int) -> dict:
    import openai

    statuses: list[int] = []
    latencies: list[float] = []
    lock = threading.Lock()
    rss_before = server.memory_info().rss

    def worker(n: int) -> None:
        for i in range(requests // clients):
            started = time.perf_counter()
            try:
                client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                    messages=[{"role": "user", "content": f"Client {n}, question {i}: name a colour."}])
                status = 200
            except openai.APIStatusError as exc:
                status = exc.status_code
            with lock:
                statuses.append(status)
                if status == 200:
                    latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"requests": len(statuses), "clients": clients, "seconds": elapsed,
            "requests_per_s": len(statuses) / elapsed, "ok": statuses.count(200), "429": statuses.count(429),
            "other": len([s for s in statuses if s not in (200, 429)]),
            "latency_p50_s": latencies[len(latencies) // 2], "latency_p95_s": latencies[int(len(latencies) * 0.95)],
            "rss_before_mib": rss_before / 2**20, "rss_after_mib": server.memory_info().rss / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)

    import openai

    from tests.serving import served_subprocess

    # the server's own settings (python -m engine serve starts with the user defaults, as the app does)
    model = DSV41Model.from_pretrained(DSV41Config(**USER_DEFAULTS, conversation_cache_mb=0))
    prompt = prompt_of(args.words)
    prompt_tokens = model.count_chat([{"role": "user", "content": prompt}])
    rows = {"engine": [], "server": []}
    with served_subprocess("--conversation-cache-mb", "0") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        through_server(client, prompt, 4)  # warm both
        in_process(model, prompt, 4)
        for _ in range(args.runs):
            rows["engine"].append(in_process(model, prompt, args.new_tokens))
            rows["server"].append(through_server(client, prompt, args.new_tokens))
        reuse = second_turn(model, client, prompt)
        load = load_test(client, psutil.Process(proc.pid), args.requests, args.clients)

    def median(side, key):
        return statistics.median(r[key] for r in rows[side])

    summary = {side: {"ttft_s": median(side, "ttft_s"), "decode_tok_s": median(side, "decode_tok_s")}
               for side in rows}
    summary["ttft_server_over_engine"] = summary["server"]["ttft_s"] / summary["engine"]["ttft_s"]
    summary["decode_server_over_engine"] = summary["server"]["decode_tok_s"] / summary["engine"]["decode_tok_s"]
    summary["ttft_added_ms"] = (summary["server"]["ttft_s"] - summary["engine"]["ttft_s"]) * 1000
    summary["same_text"] = all(r["text"] == rows["engine"][0]["text"] for side in rows for r in rows[side])
    payload = {"machine": machine(), "args": vars(args), "prompt_tokens": prompt_tokens, "runs": rows,
               "summary": summary, "second_turn": reuse, "load": load}
    e, s = summary["engine"], summary["server"]
    table = "\n".join([
        f"Prompt {prompt_tokens} tokens, {args.new_tokens} new tokens, greedy, medians of {args.runs} alternating "
        f"runs; {payload['machine']['cpu']}, {payload['machine']['torch_threads']} threads.", "",
        "| | TTFT | decode tok/s |", "|---|---|---|",
        f"| engine in process | {e['ttft_s'] * 1000:.0f} ms | {e['decode_tok_s']:.1f} |",
        f"| through the server (openai client, streamed) | {s['ttft_s'] * 1000:.0f} ms | {s['decode_tok_s']:.1f} |",
        f"| server / engine | ×{summary['ttft_server_over_engine']:.3f} ({summary['ttft_added_ms']:+.0f} ms) | "
        f"×{summary['decode_server_over_engine']:.3f} |", "",
        f"Second turn of one conversation: a chat session reads {reuse['session_second_prompt_tokens']} new tokens, "
        f"the server {reuse['server_second_prompt_tokens']} (first turn {reuse['server_first_prompt_tokens']}); "
        f"same replies: {reuse['same_replies']}.", "",
        f"Load: {load['requests']} requests from {load['clients']} clients in {load['seconds']:.1f} s "
        f"({load['requests_per_s']:.1f}/s): {load['ok']} answered, {load['429']} × 429, {load['other']} other; "
        f"latency p50 {load['latency_p50_s'] * 1000:.0f} ms, p95 {load['latency_p95_s'] * 1000:.0f} ms; server RSS "
        f"{load['rss_before_mib']:.0f} → {load['rss_after_mib']:.0f} MiB.", ""])
    folder = write_results("serve", payload, table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        for ax, key, label in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "decode_tok_s", "decode tok/s")):
            values = [summary[side][key] * (1000 if key == "ttft_s" else 1) for side in ("engine", "server")]
            ax.bar(["in process", "server"], values, color=["#4e79a7", "#f28e2b"])
            ax.set_title(label)
        fig.tight_layout()
        fig.savefig(folder / "serve.png", dpi=110)
    except ImportError:
        pass
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
