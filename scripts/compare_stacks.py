"""Two running stacks side by side through their OpenAI-compatible APIs: the same chat prompts,
greedy, interleaved (the order alternates prompt by prompt, so neither stack always goes first on
a noisy machine), each output checked equal, and the time per output token of each.

    python scripts/compare_stacks.py --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \\
        --prompts specinfer/pool/data/heldout_chat_prompts.jsonl --first 0 --count 16

Each prompt goes once to each stack: a stack's suffix drafts remember its recent outputs, so a
prompt asked twice measures that memory, not the drafts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request


def ask(base: str, messages: list[dict], max_tokens: int) -> tuple[float, int, str]:
    """(seconds, completion tokens, text) of one greedy chat completion."""
    model = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=30))["data"][0]["id"]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    reply = json.load(urllib.request.urlopen(request, timeout=600))
    return time.perf_counter() - start, reply["usage"]["completion_tokens"], reply["choices"][0]["message"]["content"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the first stack's HTTP base URL")
    parser.add_argument("--b", required=True, help="the second stack's HTTP base URL")
    parser.add_argument("--prompts", required=True, help="JSONL, one {\"messages\": [...]} a line")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with open(args.prompts) as lines:
        prompts = [json.loads(line)["messages"] for line in lines if line.strip()]
    prompts = prompts[args.first:args.first + args.count]
    stacks = {"a": args.a.rstrip("/"), "b": args.b.rstrip("/")}
    for base in stacks.values():  # warm: the first request pays for lazy set-up
        ask(base, [{"role": "user", "content": "Hi!"}], 8)
    totals = {name: [0.0, 0] for name in stacks}
    for i, messages in enumerate(prompts):
        order = list(stacks.items()) if i % 2 == 0 else list(stacks.items())[::-1]
        texts = {}
        for name, base in order:
            seconds, num_tokens, texts[name] = ask(base, messages, args.max_tokens)
            totals[name][0] += seconds
            totals[name][1] += num_tokens
        if texts["a"] != texts["b"]:
            print(f"prompt {args.first + i}: the outputs differ:\n  a: {texts['a']!r}\n  b: {texts['b']!r}", file=sys.stderr)
            return 1
    ms = {name: 1000 * seconds / max(1, num_tokens) for name, (seconds, num_tokens) in totals.items()}
    print(json.dumps({"prompts": len(prompts), "ms_per_token": ms, "outputs_equal": True,
                      "a_speedup_vs_b": round(ms["b"] / ms["a"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
