"""The live progress line on stderr: rewritten about once a second on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from loadtest import routes
from loadtest.runner import Recorder
from loadtest.stats import LevelResult, percentile


class Progress:
    """Shows what the current phase has sent and received so far; `quiet` turns it off."""

    def __init__(self, stream: TextIO = sys.stderr, quiet: bool = False):
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()

    def line(self, label: str, rec: Recorder) -> str:
        elapsed = time.perf_counter() - rec.start
        total = rec.deadline - rec.start
        failed = sum(rec.errors.values())
        recent = rec.latencies[-500:]
        p50 = f"{percentile(recent, 50) * 1000:.1f} ms" if recent else "-"
        rate = rec.ok / elapsed if elapsed > 0 else 0.0
        dropped = f"  {rec.dropped} dropped" if rec.dropped else ""
        text = (
            f"{label}  {elapsed:5.1f}/{total:.0f}s  sent {rec.sent}  ok {rec.ok}  errors {failed}{dropped}  "
            f"{rate:.0f} req/s  p50 {p50}"
        )
        if rec.streams:  # a generation level: p50 is the whole stream's; the first token's and the tokens' rate
            recent_streams = rec.streams[-500:]
            ttft = percentile([s.ttft_s for s in recent_streams], 50) * 1000
            tokens = sum(s.tokens for s in rec.streams) / elapsed if elapsed > 0 else 0.0
            text += f"  TTFT p50 {ttft:.1f} ms  {tokens:.0f} tok/s"
        return text

    async def watch(self, label: str, rec: Recorder) -> None:
        """Run beside a phase (cancel it when the phase ends)."""
        if self.quiet:
            return
        period = 1.0 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            self._write(self.line(label, rec))

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, label: str, result: LevelResult) -> None:
        if self.quiet:
            return
        lat = result.latency_ms
        p50 = f"p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} ms" if lat else "no successful responses"
        failed = sum(result.errors.values())
        text = (
            f"{label}: {result.ok} ok, {failed} errors, {result.throughput_rps:.1f} req/s, {p50} ({result.stopped_by})"
        )
        if result.is_route:
            text += f"; {routes.summary(result)}"
        ttft, itl = result.generation.get("ttft_ms"), result.generation.get("itl_ms")
        if isinstance(ttft, dict) and ttft and isinstance(itl, dict):
            itl_p50 = f"{itl['p50']:.1f} ms" if itl else "-"
            tokens = result.generation.get("output_tokens_per_s", 0.0)
            text += f"; TTFT p50 {ttft['p50']:.1f} ms, ITL p50 {itl_p50}, {tokens:.1f} output tokens/s"
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if not self.quiet:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
