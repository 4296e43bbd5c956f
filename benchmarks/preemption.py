"""Memory that grows with the sequence (issue 64's preemption bar): the generation engine alone (no server) on a decoder
whose cache is written in place, N greedy streams of P prompt + T output tokens at once against a KV budget of B
tokens. Prints the most sequences seen running at once against what reserving each one's final length would run
(B // the final length in whole pages), the preemptions counted, and whether every stream's text equals the one it
gets alone (each run alone first, one after the other).

    python -m benchmarks.preemption --models runs/bench-models [--streams 64 --prompt-tokens 256 --output-tokens 256
        --kv-cache-tokens 4096 --json out.json]

The bar: every text the same, >= 1.5 x the sequences reservation runs, preemptions > 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.generate.cli import add_decoder_options, ensure_decoder
from service.generate import GenerateRequest, GenerationEngine, GenerationSettings, SamplingParams
from service.generate.slot_cache import charge, page_tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.preemption", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.prompt_tokens + args.output_tokens > args.max_len:
        p.error(f"--prompt-tokens + --output-tokens exceed the decoder's context ({args.max_len})")
    return args


def measure(args: argparse.Namespace) -> dict:
    name = ensure_decoder(args)
    settings = GenerationSettings(threads=args.threads, kv_cache_tokens=args.kv_cache_tokens, max_running=args.streams)
    engine = GenerationEngine.open(args.models, name, settings)
    if not engine.meta.cache_in_place:
        engine.close()
        raise SystemExit(f"{name} in {args.models} concatenates its cache: export it again (its memory is reserved)")
    rng = np.random.default_rng(64)
    prompts = [rng.integers(36, 127, args.prompt_tokens).tolist() for _ in range(args.streams)]  # printable bytes
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    most = 0

    async def one(prompt: list[int]) -> list[int]:
        nonlocal most
        tokens: list[int] = []
        async for event in engine.generate(GenerateRequest(tuple(prompt), params)):
            tokens += event.token_ids
            most = max(most, engine.state().running)
        return tokens

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        start = time.perf_counter()
        alone = [asyncio.run(one(p)) for p in prompts]
        alone_s = time.perf_counter() - start
        most = 0
        start = time.perf_counter()
        mixed = asyncio.run(together())
        together_s = time.perf_counter() - start
        state = engine.state()
    finally:
        engine.close()
    final = charge(args.prompt_tokens + args.output_tokens, page_tokens(engine.meta, np.dtype(np.float32)))
    reserved = args.kv_cache_tokens // final
    same = sum(a == m for a, m in zip(alone, mixed, strict=True))
    return {
        "model": name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "most_running": most,
        "reservation_runs": reserved,
        "over_reservation": most / reserved,
        "preemptions": state.preemptions,
        "same_text": same,
        "streams": args.streams,
        "alone_s": alone_s,
        "together_s": together_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    got = measure(args)
    print(
        f"{got['model']}: {args.streams} streams of {args.prompt_tokens} + {args.output_tokens} tokens against "
        f"{args.kv_cache_tokens} tokens"
    )
    print("| most running | reservation runs | x | preemptions | same text | alone s | together s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {got['most_running']} | {got['reservation_runs']} | {got['over_reservation']:.2f} | {got['preemptions']} "
        f"| {got['same_text']} of {got['streams']} | {got['alone_s']:.1f} | {got['together_s']:.1f} |"
    )
    met = got["same_text"] == got["streams"] and got["over_reservation"] >= 1.5 and got["preemptions"] > 0
    print(f"the bar (every text the same, >= 1.5 x reservation, preemptions > 0): {'met' if met else 'not met'}")
    if args.json is not None:
        args.json.write_text(json.dumps(got, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
