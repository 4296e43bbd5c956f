"""The generation engine alone (no server): generated tokens per second of N concurrent greedy sequences on one
decoder, with the KV cache kept where the session runs between steps (ORT I/O binding) and without, in interleaved
rounds on one backend. Prints a Markdown table: median tokens/s per concurrency and the bound / plain ratio as the
median of the rounds' ratios (each round runs both back to back, so a busy machine slows both sides alike).

    python -m benchmarks.generation_engine --models models --model lm-h8-kv2-d512 --backend gpu \\
        [--concurrency 1,8,32 --max-tokens 128 --rounds 3 --json out.json]

On the CPU the two hold the cache in the same memory: the ratio there says what binding costs by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from service.generate import GenerateRequest, GenerationEngine, GenerationSettings, SamplingParams

PROMPT = "The Python tutorial: "


async def _generate(engine: GenerationEngine, sequences: int, max_tokens: int) -> float:
    """`sequences` greedy requests at once -> generated tokens per second, first submission to last event."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int) -> int:
        events = [e async for e in engine.generate(GenerateRequest(f"{PROMPT}{i}", params))]
        return sum(len(e.token_ids) for e in events)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(sequences)))
    return sum(tokens) / (time.perf_counter() - start)


def measure(args: argparse.Namespace) -> dict:
    modes = {"plain": False, "bound": True}
    engines = {}
    for mode, bound in modes.items():
        settings = GenerationSettings(
            backend=args.backend, threads=args.threads, io_binding=bound, max_running=max(args.concurrency)
        )
        engines[mode] = GenerationEngine.open(args.models, args.model, settings)
    active = {mode: e.runtime.backend for mode, e in engines.items()}
    rates: dict[int, dict[str, list[float]]] = {c: {m: [] for m in modes} for c in args.concurrency}
    try:
        for engine in engines.values():  # warm-up: every batch shape once
            asyncio.run(_generate(engine, max(args.concurrency), 8))
        for round_ in range(args.rounds):
            for c in args.concurrency:
                for mode in modes if round_ % 2 == 0 else reversed(modes):
                    rates[c][mode].append(asyncio.run(_generate(engines[mode], c, args.max_tokens)))
    finally:
        for engine in engines.values():
            engine.close()
    rows = []
    for c, by_mode in rates.items():
        ratios = [b / p for b, p in zip(by_mode["bound"], by_mode["plain"], strict=True)]
        rows.append(
            {
                "concurrency": c,
                "plain_tokens_s": statistics.median(by_mode["plain"]),
                "bound_tokens_s": statistics.median(by_mode["bound"]),
                "bound_over_plain": statistics.median(ratios),
                "ratios": ratios,
            }
        )
    return {"model": args.model, "backend": active, "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows}


def table(result: dict) -> str:
    lines = [
        f"{result['model']} on {result['backend']['bound']}, {result['max_tokens']} tokens per sequence, "
        f"{result['rounds']} rounds",
        "",
        "| sequences | plain tokens/s | bound tokens/s | bound / plain |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['plain_tokens_s']:,.0f} | {r['bound_tokens_s']:,.0f} | "
            f"{r['bound_over_plain']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generation_engine", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, required=True, help="the models folder")
    p.add_argument("--model", required=True, help="a decoder's folder name in it")
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    result = measure(args)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
