"""The load generator: K client processes (spawned: fresh interpreters, none of this process's ORT or gRPC state),
started once per run, each driving its share of a window's connections; a window sent to all, then collected."""

from __future__ import annotations

import contextlib
import multiprocessing
import time

from benchmarks.scale.loops import Command, Outcome, serve_commands

SETUP_S = 0.3  # from sending a window's commands to its warm-up: every client process has its command by then
ANSWER_GRACE_S = 60.0  # past a window's deadline, a client that has not answered is taken as hung


class ClientPool:
    """`with ClientPool(k) as pool:` k load-client processes waiting for commands."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"client processes: {k}, at least 1")
        self.k = k
        self._procs: list = []
        self._pipes: list = []

    def __enter__(self) -> ClientPool:
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.k):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve_commands, args=(child,), name=f"scale-client-{i}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._pipes.append(parent)
        return self

    def send(self, commands: list[Command]) -> float:
        """Each command to a client process of its own (the first len(commands)); the latest deadline."""
        if len(commands) > self.k:
            raise ValueError(f"{len(commands)} commands for {self.k} client processes")
        for pipe, cmd in zip(self._pipes, commands, strict=False):
            pipe.send(cmd)
        return max(cmd.deadline for cmd in commands)

    def collect(self, n: int, deadline: float) -> list[Outcome]:
        """The outcomes of the last `send` of `n` commands; RuntimeError for a client that failed or hung."""
        out = []
        for i, pipe in enumerate(self._pipes[:n]):
            if not pipe.poll(max(0.0, deadline - time.monotonic()) + ANSWER_GRACE_S):
                raise RuntimeError(f"load client {i} did not answer within {ANSWER_GRACE_S:g} s of its window's end")
            got = pipe.recv()
            if isinstance(got, Exception):
                raise RuntimeError(f"load client {i} failed: {type(got).__name__}: {got}")
            out.append(got)
        return out

    def window(
        self, protocol: str, port: int, model: str, body: str, connections: int, seconds: float, warmup_s: float
    ) -> tuple[list[Command], float, float]:
        """The commands of one window: `connections` per client process, over all of them but at c=1 (one
        connection, from the first); counting starts at the returned start and ends at the returned deadline."""
        start = time.monotonic() + SETUP_S + warmup_s
        deadline = start + seconds
        clients = 1 if connections == 1 else self.k
        commands = [Command(protocol, port, model, body, connections, start, deadline, seed=i) for i in range(clients)]
        return commands, start, deadline

    def __exit__(self, *exc) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError, ValueError):
                pipe.send(None)
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()  # one of ours, hung
                proc.join(5)
        for pipe in self._pipes:
            pipe.close()
