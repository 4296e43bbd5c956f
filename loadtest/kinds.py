"""Which kind of model a run loads, classifiers or decoders (a run loads one kind), and the settings that only a
generation run has: its protocols, prompt and output lengths, SLOs, and the server histograms it reads.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from loadtest import server_metrics
from loadtest.discovery import DiscoveryError, ModelInfo
from loadtest.session import Outcome, Plan
from loadtest.stats import Slo
from loadtest.streams import DEFAULT_GENERATION_PROTOCOL, GENERATION_PROTOCOLS, TokenSpec
from loadtest.workload import DEFAULT_PROTOCOL, PROTOCOLS, WorkloadError, parse_protocols


def protocols(args: argparse.Namespace) -> tuple[tuple[str, ...], bool | None]:
    """--protocol's list (empty when not given: the kind's default) and whether the run generates (True: --generate
    or a generation-only protocol; False: a classifier-only protocol; None: as the models are)."""
    if args.protocol is None:
        return (), True if args.generate else None
    names = tuple(name.strip() for name in args.protocol.split(",") if name.strip())
    generation_only = [n for n in names if n in GENERATION_PROTOCOLS and n not in PROTOCOLS]
    if args.generate or generation_only:
        wrong = [n for n in names if n not in GENERATION_PROTOCOLS]
        if wrong or len(set(names)) != len(names) or not names:
            raise WorkloadError(
                f"--protocol {args.protocol!r}: generation takes one or more of {', '.join(GENERATION_PROTOCOLS)}, "
                "each once" + (f" ({', '.join(wrong)} is a classifier's)" if wrong else "")
            )
        return names, True
    parsed = parse_protocols(args.protocol)
    return parsed, None if parsed == ("grpc",) else False


def generation_settings(args: argparse.Namespace) -> tuple[TokenSpec, TokenSpec, Slo]:
    """The generation flags, checked whatever the run turns out to load (a bad one is a mistake either way)."""
    prompt = TokenSpec.parse(args.prompt_tokens, "--prompt-tokens", least=2)  # BOS and one byte at least
    output = TokenSpec.parse(args.output_tokens, "--output-tokens", least=1)
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-itl-ms", args.slo_itl_ms)):
        if value is not None and not value > 0:
            raise WorkloadError(f"{flag} must be > 0 ms, got {value:g}")
    return prompt, output, Slo(args.slo_ttft_ms, args.slo_itl_ms)


def settle_kind(
    args: argparse.Namespace, plan: Plan, models: list[ModelInfo], outcome: Outcome
) -> tuple[Plan, list[ModelInfo]]:
    """Classifiers or decoders: a run loads one kind. `--models all` keeps the kind asked for (--generate, or a
    protocol only one kind has), else classifiers where any are served (a note names the decoders left out); named
    models must all be of that kind. DiscoveryError says what does not fit."""
    everything = args.models.strip() == "all"
    known = [m for m in models if m.measurable]  # a model still loading has no known kind; it fails as not ready
    decoders = [m.name for m in known if m.is_decoder]
    generate = plan.generate if plan.generate is not None else bool(known) and len(decoders) == len(known)
    wrong = [m.name for m in known if m.is_decoder != generate]
    if wrong and everything:
        outcome.notes.append(
            f"not measured: {', '.join(wrong)} ("
            + ("classifiers: a generation run loads decoders)" if generate else "decoders: give --generate)")
        )
        models = [m for m in models if m.name not in wrong]
    elif wrong:
        if generate:
            raise DiscoveryError(f"{', '.join(wrong)}: a classifier, and a generation run loads decoders only")
        raise DiscoveryError(
            f"{', '.join(wrong)}: a decoder; load decoders in a run of their own (--generate, protocol "
            f"{', '.join(GENERATION_PROTOCOLS)})"
        )
    if not models:
        raise DiscoveryError(f"the service at {plan.base_url} serves no {'decoders' if generate else 'classifiers'}")
    if not generate:
        return replace(plan, generate=False, protocols=plan.protocols or (DEFAULT_PROTOCOL,)), models
    tight = [f"{m.name} ({m.max_len})" for m in models if m.max_len - plan.output_tokens.high < 2]
    if tight:
        raise DiscoveryError(
            f"--output-tokens {plan.output_tokens.describe()} leaves no room for a prompt in the context of "
            + ", ".join(tight)
        )
    names = plan.metrics_names if args.metrics_name else server_metrics.GENERATION_METRICS
    return replace(
        plan,
        generate=True,
        protocols=plan.protocols or (DEFAULT_GENERATION_PROTOCOL,),
        metrics_names=names,
        metrics_also=server_metrics.GENERATION_ALSO,
        metrics_last=server_metrics.GENERATION_LAST,
    ), models


def workload_meta(args: argparse.Namespace, plan: Plan) -> dict:
    """The settings that depend on the kind of models loaded (known once they are found)."""
    meta: dict = {"protocol": ",".join(plan.protocols), "workload": "generate" if plan.generate else "classify"}
    if args.metrics_url:
        meta["metrics_names"] = list(plan.metrics_names + plan.metrics_also)
    if plan.generate:
        meta |= {"prompt_tokens": plan.prompt_tokens.describe(), "output_tokens": plan.output_tokens.describe()}
        meta |= {"slo_ttft_ms": plan.slo.ttft_ms, "slo_itl_ms": plan.slo.itl_ms}
    return meta
