#!/usr/bin/env python3
"""A load generator for any OpenAI-compatible completions server (`pagedattn serve`,
llama.cpp's llama-server, vLLM), after vLLM's benchmark_serving.py: N requests arriving as a
Poisson process at R requests per second (open loop: a request is sent at its arrival whatever
the server is doing), each a streaming `POST /v1/completions` of token ids, greedy, generating
exactly its drawn length (`ignore_eos`). Prints one table row per rate: completed / refused /
failed requests, duration, request and token throughput, time to first token, time per output
token and inter-token latency; `--json` writes them with every request's record.

    python3 bench/serve_load.py --url http://127.0.0.1:8000 [--model NAME] --requests 200 \
        --rate 1 --rate 4 --rate inf [--seed 0] [--warmup 4] [--max-concurrency C] \
        [--max-prompt 1024] [--max-output 1024] [--vocab 49152] [--first-token 100] [--json OUT]

The requests are the engine's built-in `chat` workload, drawn as `pagedattn run --workload chat
--rate R --seed S` draws them (same generator, same order of draws; `--first-token` is where it
takes the model's first plain token): prompt lengths log-normal around a median of 100 tokens
(sigma 1.0, clamped to [4, 1024], then cut to `--max-prompt`), output lengths around 200 (sigma
0.8, [4, 1024], cut to `--max-output`), prompt ids uniform in [first-token, vocab). Every rate of
a sweep serves the same lengths, the first rate the draw's prompt ids and each later one fresh
ids (a prompt cache would serve a repeated prompt from the cache: llama-server's does). A
rate's arrivals are the draw's unit-rate exponential gaps divided by the rate, shifted so that
the first request arrives at 0 (`inf`: all at once). `--warmup K` first serves K other requests of
the same workload, all at once, unmeasured.

Per request: TTFT is the time from sending to the first chunk carrying text; TPOT (end - first)
/ (output tokens - 1), end being the last chunk carrying text; ITL the gaps between text chunks,
a gap split evenly over a chunk's tokens where the chunk says how many (cumulative `usage` on
every chunk, or `logprobs`), else counted as one token; output tokens from the final `usage`,
else the chunks counted. HTTP 429 and 503 count as refused, any other error (status, error event
in the stream, connection error, timeout) as failed, with the body kept in the JSON. Needs
aiohttp (bench/requirements.txt).
"""
import argparse, asyncio, json, math, sys, time

import aiohttp

MASK = (1 << 64) - 1


class SplitMix64:
    """The engine's generator (crates/pagedattn-engine/src/rng.rs), bit for bit."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def next_f64(self):
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def lognormal(rng, median, sigma, lo, hi):
    """The engine's draw (harness/workload.rs): Box-Muller, rounded half away from 0, clamped."""
    u, v = 1.0 - rng.next_f64(), rng.next_f64()
    z = math.sqrt(-2.0 * math.log(u)) * math.cos(math.tau * v)
    return min(max(math.floor(median * math.exp(sigma * z) + 0.5), lo), hi)


def chat_workload(n, seed, args):
    """n requests of the `chat` workload: (unit-rate arrival gap, prompt ids, output length)."""
    rng = SplitMix64(seed ^ 0x005EED0F10AD)
    span = max(args.vocab - args.first_token, 1)
    out = []
    for _ in range(n):
        gap = -math.log(1.0 - rng.next_f64())  # drawn first, as the engine does with a rate
        prompt_len = lognormal(rng, 100.0, 1.0, 4, 1024)
        output_len = lognormal(rng, 200.0, 0.8, 4, 1024)
        ids = [args.first_token + rng.next_u64() % span for _ in range(prompt_len)]
        out.append((gap, ids[: args.max_prompt], min(output_len, args.max_output)))
    return out


def fresh_ids(work, seed, sweep_index, args):
    """The workload with new prompt ids of the same lengths, for a sweep's later rates: a
    server's prompt cache would serve a repeated prompt from the cache."""
    if sweep_index == 0:
        return work
    rng = SplitMix64((seed ^ 0x0A11D5EED000) + sweep_index)
    span = max(args.vocab - args.first_token, 1)
    return [(gap, [args.first_token + rng.next_u64() % span for _ in ids], out)
            for gap, ids, out in work]


def text_prompt(n):
    """The fallback for a server that refuses token ids: n words that most BPE vocabularies
    encode as one token each (approximately n tokens; the server's usage says how many)."""
    return "the" + " the" * (n - 1)


class Client:
    def __init__(self, args, session):
        self.args, self.session = args, session
        self.url = args.url.rstrip("/") + args.endpoint
        self.token_prompts = True

    def payload(self, ids, max_tokens):
        body = {
            "model": self.args.model,
            "prompt": ids if self.token_prompts else text_prompt(len(ids)),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": not self.args.no_stream,
        }
        if not self.args.no_stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def request(self, ids, max_tokens):
        """Sends one request and reads its stream; returns its record (times in ms)."""
        rec = {"prompt_tokens": len(ids), "requested_output_tokens": max_tokens, "status": None,
               "outcome": "failed", "error": None, "output_tokens": 0, "chunks": 0,
               "ttft_ms": None, "tpot_ms": None, "e2e_ms": None, "itl_ms": []}
        start = time.perf_counter()
        rec["sent"] = start
        first = last = None
        counted, usage, done = 0, None, False
        try:
            async with self.session.post(self.url, json=self.payload(ids, max_tokens)) as resp:
                rec["status"] = resp.status
                if resp.status != 200:
                    rec["error"] = (await resp.text())[:4000]
                    rec["outcome"] = "refused" if resp.status in (429, 503) else "failed"
                    return rec
                if self.args.no_stream:
                    # One answer: its whole latency is the first token's (TTFT = e2e).
                    usage = (await resp.json()).get("usage") or {}
                    rec["e2e_ms"] = rec["ttft_ms"] = (time.perf_counter() - start) * 1e3
                    rec["output_tokens"] = usage.get("completion_tokens", 0)
                    rec["outcome"] = "completed"
                    return rec
                buf = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += data.replace(b"\r\n", b"\n")
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue  # SSE comments (pings), event names
                            body = line[5:].strip()
                            if body == b"[DONE]":
                                done = True
                                continue
                            chunk = json.loads(body)
                            if "error" in chunk:
                                err = chunk["error"]
                                rec["error"] = json.dumps(err)[:4000]
                                code = err.get("code") if isinstance(err, dict) else None
                                rec["outcome"] = "refused" if code in (429, 503) else "failed"
                                return rec
                            usage = chunk.get("usage") or usage
                            choices = chunk.get("choices") or []
                            text = "".join(c.get("text") or "" for c in choices)
                            if not text:
                                continue
                            k = chunk_tokens(chunk, choices, counted)
                            counted += k
                            rec["chunks"] += 1
                            if first is None:
                                first = now
                            else:
                                rec["itl_ms"].extend([(now - last) * 1e3 / k] * k)
                            last = now
            end = time.perf_counter()
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            return rec
        if usage and usage.get("prompt_tokens") is not None:
            rec["prompt_tokens"] = usage["prompt_tokens"]
        rec["output_tokens"] = usage["completion_tokens"] if usage and "completion_tokens" in usage else counted
        rec["usage"] = usage
        rec["done_marker"] = done
        rec["e2e_ms"] = (end - start) * 1e3
        if first is None:
            if done and rec["output_tokens"] > 0:
                # Every token decoded to no text (special tokens: under ignore_eos a model may
                # repeat its end of turn): served, its text empty, its first token seen at the
                # end.
                rec["outcome"], rec["ttft_ms"], rec["no_text"] = "completed", rec["e2e_ms"], True
                return rec
            rec["error"] = "the stream carried no text"
            return rec
        rec["outcome"] = "completed"
        rec["ttft_ms"] = (first - start) * 1e3
        if rec["output_tokens"] > 1:
            rec["tpot_ms"] = (last - first) * 1e3 / (rec["output_tokens"] - 1)
        return rec


def chunk_tokens(chunk, choices, counted):
    """How many tokens a text chunk carries, where it says: a cumulative usage on every chunk
    (vLLM's continuous_usage_stats), or logprobs (OpenAI's completions `tokens` list,
    llama-server's `content` list); else 1."""
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens"):
        return max(usage["completion_tokens"] - counted, 1)
    for c in choices:
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            for key in ("tokens", "content"):
                if isinstance(lp.get(key), list) and lp[key]:
                    return len(lp[key])
    return 1


def percentile(xs, q):
    """numpy's default (linear) percentile; None when xs is empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def session_for(args):
    """The HTTP session: no client-side cap on connections (the arrivals decide), and a new
    connection per request (a pooled keep-alive connection that the server closed while idle,
    as llama-server does after 5 s, fails the next request sent on it)."""
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=timeout)


async def serve_shard(args, token_prompts, shard, t0):
    """One process's share of a rate: (index, arrival, ids, output length) each sent at
    t0 + arrival (t0 on the monotonic clock every process shares)."""
    async with session_for(args) as session:
        client = Client(args, session)
        client.token_prompts = token_prompts

        async def one(i, arrival, ids, out):
            await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
            rec = await client.request(ids, out)
            rec["index"], rec["arrival_s"], rec["sent_s"] = i, arrival, rec.pop("sent") - t0
            rec["end_s"] = time.perf_counter() - t0
            return rec

        return await asyncio.gather(*(one(*item) for item in shard))


def shard_process(args, token_prompts, shard, t0):
    return asyncio.run(serve_shard(args, token_prompts, shard, t0))


async def run_rate(client, work, rate, max_concurrency):
    """Serves the whole workload at one rate; returns the rate's summary and records."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals, clock = [], 0.0
    for i, (gap, _, _) in enumerate(work):
        clock += gap if i else 0.0  # the first arrives at 0
        arrivals.append(0.0 if math.isinf(rate) else clock / rate)
    if client.args.processes > 1 and not max_concurrency:
        # The requests dealt round-robin to processes (one client process parses ~25k chunks
        # a second: a GPU server outruns it), all on one schedule.
        import concurrent.futures
        items = [(i, arrivals[i], ids, out) for i, (_, ids, out) in enumerate(work)]
        t0 = time.perf_counter() + 1.0
        with concurrent.futures.ProcessPoolExecutor(client.args.processes) as pool:
            futures = [pool.submit(shard_process, client.args, client.token_prompts,
                                   items[k::client.args.processes], t0)
                       for k in range(client.args.processes)]
            records = sorted((r for f in futures for r in f.result()), key=lambda r: r["index"])
        duration = max(r["end_s"] for r in records)
        return summarize(rate, records, duration), records
    t0 = time.perf_counter()

    async def one(i):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        if sem:
            async with sem:
                rec = await client.request(work[i][1], work[i][2])
        else:
            rec = await client.request(work[i][1], work[i][2])
        rec["index"], rec["arrival_s"], rec["sent_s"] = i, arrivals[i], rec.pop("sent") - t0
        return rec

    records = await asyncio.gather(*(one(i) for i in range(len(work))))
    duration = time.perf_counter() - t0
    return summarize(rate, records, duration), records


async def run_closed(client, work, concurrency, duration):
    """`concurrency` clients, each sending the workload's next request as soon as its last one
    ended, until `duration` seconds have passed (a soak: the workload is cycled, each round
    with fresh prompt ids); returns the summary and records as `run_rate` does."""
    t0 = time.perf_counter()
    state = {"next": 0}

    async def client_loop():
        records = []
        while time.perf_counter() - t0 < duration:
            i = state["next"]
            state["next"] += 1
            _, ids, out = work[i % len(work)]
            if i >= len(work):  # a later round: new ids, so that no prompt repeats
                rng = SplitMix64(0x50A4 + i)
                ids = [client.args.first_token + rng.next_u64() % max(client.args.vocab - client.args.first_token, 1) for _ in ids]
            rec = await client.request(ids, out)
            rec["index"], rec["arrival_s"], rec["sent_s"] = i, rec["sent"] - t0, rec.pop("sent") - t0
            records.append(rec)
        return records

    lists = await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    records = sorted((r for rs in lists for r in rs), key=lambda r: r["index"])
    return summarize(f"closed x{concurrency}", records, time.perf_counter() - t0), records


def write_trace(path, work):
    """The workload as a `pagedattn run --trace` file: the same requests, all at once, greedy,
    `ignore_eos` (what the server got at rate inf)."""
    with open(path, "w") as f:
        for _, ids, out in work:
            f.write(json.dumps({"tokens": ids, "max_new_tokens": out, "temperature": 0,
                                "ignore_eos": True}) + "\n")


def summarize(rate, records, duration):
    ok = [r for r in records if r["outcome"] == "completed"]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    ttft = [r["ttft_ms"] for r in ok]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    itl = [x for r in ok for x in r["itl_ms"]]
    e2e = [r["e2e_ms"] for r in ok]
    chunks = sum(r["chunks"] for r in ok)
    return {
        "rate": rate if isinstance(rate, str) else ("inf" if math.isinf(rate) else rate),
        "requests": len(records),
        "completed": len(ok),
        "refused": sum(r["outcome"] == "refused" for r in records),
        "failed": sum(r["outcome"] == "failed" for r in records),
        # ignore_eos: a completed request generating fewer tokens than asked was cut short
        # (a context limit, a server ignoring ignore_eos).
        "short": sum(r["output_tokens"] < r["requested_output_tokens"] for r in ok),
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requested_output_tokens": sum(r["requested_output_tokens"] for r in ok),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": {"mean": mean(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tpot_ms": {"mean": mean(tpot), "p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "itl_ms": {"mean": mean(itl), "p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "e2e_ms": {"mean": mean(e2e), "p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
    }


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def table(summaries):
    head = ("| rate | done | refused | failed | s | req/s | out tok/s | total tok/s "
            "| TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | ITL p50 / p99 ms |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for s in summaries:
        t, p, i = s["ttft_ms"], s["tpot_ms"], s["itl_ms"]
        lines.append(
            f"| {s['rate']} | {s['completed']} | {s['refused']} | {s['failed']} "
            f"| {s['duration_s']:.2f} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} "
            f"| {s['total_token_throughput']:.1f} | {fmt(t['mean'])} / {fmt(t['p50'])} / {fmt(t['p99'])} "
            f"| {fmt(p['mean'], 2)} / {fmt(p['p50'], 2)} / {fmt(p['p99'], 2)} "
            f"| {fmt(i['p50'], 2)} / {fmt(i['p99'], 2)} |")
    return "\n".join(lines)


async def resolve_model(client):
    """The first model /v1/models lists (for a server whose name one doesn't know)."""
    async with client.session.get(client.args.url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def probe(client):
    """One tiny request: checks the server answers, and falls back to text prompts where it
    refuses token ids."""
    ids = [client.args.first_token] * 4
    rec = await client.request(ids, 2)
    if rec["outcome"] == "completed":
        return
    if rec["status"] and 400 <= rec["status"] < 500 and rec["status"] != 429:
        client.token_prompts = False
        text = await client.request(ids, 2)
        if text["outcome"] == "completed":
            print(f"serve_load: the server refused a token-id prompt (HTTP {rec['status']}: "
                  f"{rec['error']}); sending text prompts instead, \"the the ...\" with as many "
                  "words as the drawn prompt has tokens: prompt lengths are now approximate "
                  "(the JSON's prompt_tokens are the server's counts)", file=sys.stderr)
            return
        rec = text
    sys.exit(f"serve_load: the probe request failed (HTTP {rec['status']}): {rec['error']}")


async def main_async(args):
    async with session_for(args) as session:
        client = Client(args, session)
        if args.model is None:
            args.model = await resolve_model(client)
            print(f"serve_load: model {args.model!r} (from /v1/models)", file=sys.stderr)
        await probe(client)
        if args.warmup:
            warm = chat_workload(args.warmup, args.seed + 1, args)
            s, _ = await run_rate(client, warm, math.inf, args.max_concurrency)
            print(f"serve_load: warm-up: {s['completed']}/{args.warmup} completed in "
                  f"{s['duration_s']:.2f} s", file=sys.stderr)
        work = chat_workload(args.requests, args.seed, args)
        print(f"serve_load: {len(work)} requests, {sum(len(w[1]) for w in work)} prompt tokens, "
              f"{sum(w[2] for w in work)} output tokens asked", file=sys.stderr)
        if args.write_trace:
            write_trace(args.write_trace, work)
        results = []
        if args.duration:
            summary, records = await run_closed(client, work, args.max_concurrency, args.duration)
            results.append({"summary": summary, "requests": records})
            print(f"serve_load: {summary['completed']} completed, {summary['refused']} refused, "
                  f"{summary['failed']} failed in {summary['duration_s']:.1f} s", file=sys.stderr)
        for j, rate in enumerate([] if args.duration else args.rate):
            summary, records = await run_rate(client, fresh_ids(work, args.seed, j, args), rate,
                                              args.max_concurrency)
            print(f"serve_load: rate {summary['rate']}: {summary['completed']} completed, "
                  f"{summary['refused']} refused, {summary['failed']} failed, {summary['short']} "
                  f"short, {summary['output_tokens']}/{summary['requested_output_tokens']} output "
                  f"tokens, {fmt(summary['tokens_per_chunk'], 2)} tokens a chunk, "
                  f"{summary['duration_s']:.2f} s", file=sys.stderr)
            for r in records:
                if r["outcome"] != "completed" and r["error"]:
                    print(f"serve_load:   request {r['index']}: {r['outcome']} (HTTP "
                          f"{r['status']}): {r['error'][:300]}", file=sys.stderr)
                    break  # the first one says enough; the JSON has them all
            results.append({"summary": summary, "requests": records})
    print(table([r["summary"] for r in results]))
    if args.json:
        config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                  for k, v in vars(args).items() if k != "rate"}
        config["rate"] = ["inf" if math.isinf(r) else r for r in args.rate]
        config["token_prompts"] = client.token_prompts
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": results}, f, indent=1)


def positive_rate(s):
    r = float(s)
    if not r > 0:
        raise argparse.ArgumentTypeError("a rate is a number > 0 or inf")
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="the request's model field (default: /v1/models' first)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=positive_rate, action="append",
                   help="requests per second, `inf`: all at once; repeat for a sweep (default inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, metavar="K")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (the others wait at the client)")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=49152, help="prompt ids are below it")
    p.add_argument("--first-token", type=int, default=100, help="prompt ids are from it on")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a request may take")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="instead of rates: --max-concurrency clients in a closed loop for this "
                        "long (a soak)")
    p.add_argument("--write-trace", metavar="FILE.jsonl",
                   help="also write the measured requests as a `pagedattn run --trace` file")
    p.add_argument("--processes", type=int, default=1,
                   help="client processes sharing each rate's requests (not with "
                        "--max-concurrency or --duration): one parses ~25k chunks a second")
    p.add_argument("--no-stream", action="store_true",
                   help="plain (not streamed) requests: throughput without the streaming's work")
    p.add_argument("--dry-run", action="store_true",
                   help="only write --write-trace's file (no server needed)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    if args.dry_run:
        if not args.write_trace:
            p.error("--dry-run writes --write-trace's file: give it")
        write_trace(args.write_trace, chat_workload(args.requests, args.seed, args))
        return
    if args.duration is not None and not (args.duration > 0 and args.max_concurrency):
        p.error("--duration needs a positive number of seconds and --max-concurrency")
    args.rate = args.rate or [math.inf]
    if args.requests < 1 or args.max_prompt < 1 or args.max_output < 1:
        p.error("--requests, --max-prompt and --max-output must be >= 1")
    if not 0 <= args.first_token < args.vocab:
        p.error("need 0 <= --first-token < --vocab")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
