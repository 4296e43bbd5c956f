"""The head-count sweep's report: one row per h (mean and spread over seeds; the int8 twin of each h's seed-0 model),
the tables (Markdown, CSV, JSON), the quality-versus-latency plot, and a verdict per claim computed from the numbers.
Torch-free.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean, pstdev

from export.sweep_timing import Int8Twin

SMALL_HEAD_DIM = 64  # the claim: training is unstable when head_dim < 64
BALANCED_HEADS = (4, 8)  # the claim: the best quality/latency balance is around 4-8 heads
BALANCE_MIN_TOLERANCE = 0.005  # accuracy within max(this, the best h's seed spread) of the best counts as "as good"


@dataclass(frozen=True)
class Run:
    """One trained configuration, one seed."""

    heads: int
    head_dim: int
    seed: int
    params: int
    val_loss: float
    val_acc: float
    train_s: float
    spikes: int
    max_grad_norm: float


@dataclass(frozen=True)
class Row:
    """One head count, over its seeds; latencies are p50 in milliseconds (nan when not measured)."""

    heads: int
    head_dim: int
    params: int
    seeds: int
    val_loss_mean: float
    val_loss_std: float
    val_acc_mean: float
    val_acc_std: float
    train_s_mean: float
    p50_b1_ms: float
    p50_b32_ms: float
    spikes_per_run: float
    max_grad_norm_mean: float  # the mean over seeds of each run's largest gradient norm (before clipping)
    # int8: the seed-0 model (the exported one) quantized, on the validation split in ONNX Runtime (nan: not measured)
    int8_val_acc: float = math.nan
    int8_fp32_val_acc: float = math.nan  # the same fp32 model on the same split in ORT: what int8 is set against
    int8_agreement: float = math.nan  # fraction of inputs whose argmax equals the fp32 model's
    int8_p50_b1_ms: float = math.nan  # timed in the same interleaved rounds as the fp32 models
    int8_p50_b32_ms: float = math.nan

    @property
    def has_int8(self) -> bool:
        return not math.isnan(self.int8_agreement)


@dataclass(frozen=True)
class Verdict:
    claim: str
    verdict: str  # "supported", "not supported", "mixed" or "cannot check"
    evidence: str


def summarize(
    runs: list[Run],
    latency: dict[int, tuple[float, float]],
    int8: dict[int, Int8Twin] | None = None,
    int8_latency: dict[int, tuple[float, float]] | None = None,
) -> list[Row]:
    """Rows sorted by h; `latency` maps h to (batch-1 p50 ms, batch-32 p50 ms), `int8_latency` the same for the int8
    twins in `int8`."""
    int8, int8_latency = int8 or {}, int8_latency or {}
    rows = []
    for h in sorted({r.heads for r in runs}):
        mine = [r for r in runs if r.heads == h]
        b1, b32 = latency.get(h, (math.nan, math.nan))
        twin = int8.get(h)
        q_b1, q_b32 = int8_latency.get(h, (math.nan, math.nan))
        rows.append(
            Row(
                heads=h,
                head_dim=mine[0].head_dim,
                params=mine[0].params,
                seeds=len(mine),
                val_loss_mean=mean(r.val_loss for r in mine),
                val_loss_std=pstdev(r.val_loss for r in mine),
                val_acc_mean=mean(r.val_acc for r in mine),
                val_acc_std=pstdev(r.val_acc for r in mine),
                train_s_mean=mean(r.train_s for r in mine),
                p50_b1_ms=b1,
                p50_b32_ms=b32,
                spikes_per_run=mean(r.spikes for r in mine),
                max_grad_norm_mean=mean(r.max_grad_norm for r in mine),
                int8_val_acc=_or_nan(twin and twin.accuracy),
                int8_fp32_val_acc=_or_nan(twin and twin.fp32_accuracy),
                int8_agreement=_or_nan(twin and twin.agreement),
                int8_p50_b1_ms=q_b1,
                int8_p50_b32_ms=q_b32,
            )
        )
    return rows


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def markdown_table(rows: list[Row]) -> str:
    head = (
        "| h | head_dim | params | val loss | val acc | train s | p50 batch 1 (ms) | p50 batch 32 (ms) "
        "| loss spikes / run | max grad norm |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r.heads} | {r.head_dim} | {r.params:,} | {r.val_loss_mean:.4f} ± {r.val_loss_std:.4f} "
        f"| {r.val_acc_mean:.4f} ± {r.val_acc_std:.4f} | {r.train_s_mean:.1f} | {r.p50_b1_ms:.3f} "
        f"| {r.p50_b32_ms:.3f} | {r.spikes_per_run:.2f} | {r.max_grad_norm_mean:.2f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def _fp32_to_int8(fp32_ms: float, int8_ms: float) -> str:
    return f"{fp32_ms:.3f} → {int8_ms:.3f} ({int8_ms / fp32_ms:.2f}x)"


def int8_table(rows: list[Row]) -> str:
    """fp32 and int8 side by side for each h's seed-0 model; empty when no int8 twin was measured."""
    measured = [r for r in rows if r.has_int8]
    if not measured:
        return ""
    head = (
        "| h | val acc, fp32 | val acc, int8 | int8 - fp32 | argmax agreement | p50 batch 1 (ms), fp32 → int8 "
        "| p50 batch 32 (ms), fp32 → int8 |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r.heads} | {r.int8_fp32_val_acc:.4f} | {r.int8_val_acc:.4f} | {r.int8_val_acc - r.int8_fp32_val_acc:+.4f} "
        f"| {r.int8_agreement:.2%} | {_fp32_to_int8(r.p50_b1_ms, r.int8_p50_b1_ms)} "
        f"| {_fp32_to_int8(r.p50_b32_ms, r.int8_p50_b32_ms)} |"
        for r in measured
    ]
    return head + "\n".join(lines) + "\n"


def int8_note(settings: dict[str, object]) -> str:
    """How the int8 twins were made and measured, from the sweep's settings (its "int8" record)."""
    method = settings.get("int8")
    if not isinstance(method, dict):
        return ""
    weights = f"{method['weights']} weights, " + ("7 bits (reduce_range)" if method["reduce_range"] else "full range")
    return (
        f"ONNX Runtime's {method['mode']} quantization ({weights}: {method['why']}). Accuracy of both models in ONNX "
        f"Runtime on the same inputs ({method['data']}); each twin timed in the same interleaved rounds as the fp32 "
        "models."
    )


def _by_heads(rows: list[Row]) -> dict[int, Row]:
    return {r.heads: r for r in rows}


def check_balance(rows: list[Row]) -> Verdict:
    claim = f"the best quality/latency balance is around {BALANCED_HEADS[0]}-{BALANCED_HEADS[1]} heads"
    timed = [r for r in rows if not math.isnan(r.p50_b1_ms)]
    inside = [r for r in timed if BALANCED_HEADS[0] <= r.heads <= BALANCED_HEADS[1]]
    if not inside or len(inside) == len(timed):
        swept = sorted(r.heads for r in timed)
        return Verdict(claim, "cannot check", f"needs timed h inside and outside {BALANCED_HEADS}; timed {swept}")
    best = max(timed, key=lambda r: r.val_acc_mean)
    tol = max(BALANCE_MIN_TOLERANCE, best.val_acc_std)
    good = [r for r in timed if r.val_acc_mean >= best.val_acc_mean - tol]
    pick = min(good, key=lambda r: (r.p50_b1_ms, r.heads))
    evidence = (
        f"best accuracy: h={best.heads} ({best.val_acc_mean:.4f} ± {best.val_acc_std:.4f}); within {tol:.4f} of it: "
        f"h in {{{', '.join(str(r.heads) for r in good)}}}; of those, h={pick.heads} is fastest at batch 1 "
        f"({pick.p50_b1_ms:.3f} ms p50, accuracy {pick.val_acc_mean:.4f})"
    )
    return Verdict(claim, "supported" if pick in inside else "not supported", evidence)


def check_diminishing_returns(rows: list[Row]) -> Verdict:
    pivot = BALANCED_HEADS[1]
    claim = f"diminishing returns beyond {pivot} heads"
    by = _by_heads(rows)
    low, high = min(by), max(by)
    if pivot not in by or low >= pivot or high <= pivot:
        return Verdict(claim, "cannot check", f"needs h below, at and above {pivot}; swept {sorted(by)}")
    before = (by[pivot].val_acc_mean - by[low].val_acc_mean) / math.log2(pivot / low)
    after = (by[high].val_acc_mean - by[pivot].val_acc_mean) / math.log2(high / pivot)
    noise = max(by[pivot].val_acc_std, by[high].val_acc_std)
    within = abs(by[high].val_acc_mean - by[pivot].val_acc_mean) <= noise
    evidence = (
        f"accuracy gain per doubling of h: {before:+.4f} from h={low} to h={pivot}, {after:+.4f} from h={pivot} to "
        f"h={high} ({'within' if within else 'outside'} the seed spread of {noise:.4f})"
    )
    if not math.isnan(by[pivot].p50_b1_ms) and not math.isnan(by[high].p50_b1_ms):
        ratio = by[high].p50_b1_ms / by[pivot].p50_b1_ms
        evidence += f"; batch-1 latency h={high} / h={pivot}: {ratio:.2f}x"
    return Verdict(claim, "supported" if after < before else "not supported", evidence)


def check_instability(rows: list[Row]) -> Verdict:
    claim = f"training is unstable when head_dim < {SMALL_HEAD_DIM} (loss spikes, large gradient norms)"
    small = [r for r in rows if r.head_dim < SMALL_HEAD_DIM]
    large = [r for r in rows if r.head_dim >= SMALL_HEAD_DIM]
    if not small or not large:
        dims = sorted({r.head_dim for r in rows})
        return Verdict(claim, "cannot check", f"needs head_dim on both sides of {SMALL_HEAD_DIM}; swept {dims}")

    def group(rs: list[Row]) -> tuple[float, float, float]:
        runs = sum(r.seeds for r in rs)
        spikes = sum(r.spikes_per_run * r.seeds for r in rs) / runs
        grad = sum(r.max_grad_norm_mean * r.seeds for r in rs) / runs
        spread = mean(r.val_loss_std for r in rs)
        return spikes, grad, spread

    s_spikes, s_grad, s_spread = group(small)
    l_spikes, l_grad, l_spread = group(large)
    evidence = (
        f"head_dim < {SMALL_HEAD_DIM} (h in {{{', '.join(str(r.heads) for r in small)}}}): {s_spikes:.2f} spikes/run, "
        f"max grad norm {s_grad:.2f}, val-loss seed spread {s_spread:.4f}; head_dim >= {SMALL_HEAD_DIM} "
        f"(h in {{{', '.join(str(r.heads) for r in large)}}}): {l_spikes:.2f} spikes/run, max grad norm {l_grad:.2f}, "
        f"val-loss seed spread {l_spread:.4f}"
    )
    worse = [s_spikes > l_spikes, s_grad > l_grad, s_spread > l_spread]
    verdict = "supported" if all(worse) else "not supported" if not any(worse) else "mixed"
    return Verdict(claim, verdict, evidence)


def verdicts(rows: list[Row]) -> list[Verdict]:
    return [check_balance(rows), check_diminishing_returns(rows), check_instability(rows)]


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Validation accuracy (mean, error bar = seed spread) against p50 latency at batch 1 and 32, one point per h;
    with int8 twins measured, their accuracy (seed-0 model) against their p50 as a second curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, batch in ((axes[0], "p50_b1_ms", 1), (axes[1], "p50_b32_ms", 32)):
        xs = [getattr(r, key) for r in rows]
        ys = [r.val_acc_mean for r in rows]
        ax.errorbar(xs, ys, yerr=[r.val_acc_std for r in rows], fmt="o-", capsize=3, label="fp32 (mean ± sd, seeds)")
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(f"h={r.heads}", (x, y), textcoords="offset points", xytext=(5, -12), fontsize=8)
        measured = [r for r in rows if r.has_int8]
        if measured:
            qx = [getattr(r, f"int8_{key}") for r in measured]
            qy = [r.int8_val_acc for r in measured]
            ax.plot(qx, qy, "x--", color="tab:orange", label="int8, dynamic (seed-0 model)")
            for r, x, y in zip(measured, qx, qy, strict=True):
                ax.annotate(f"h={r.heads}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel(f"p50 latency, batch {batch} (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation accuracy")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _finite(value: object) -> object:
    """NaN (not measured) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_report(out: Path, rows: list[Row], runs: list[Run], settings: dict[str, object], title: str) -> list[Path]:
    """sweep.md, sweep.csv, sweep.json and sweep.png in `out`; returns their paths."""
    found = verdicts(rows)
    claims = "\n".join(f"- **{v.claim}**: {v.verdict}. {v.evidence}." for v in found)
    md = f"# {title}\n\n{markdown_table(rows)}\n"
    if int8_table(rows):
        md += "## int8 (dynamic quantization of each h's seed-0 model)\n\n"
        md += f"{int8_table(rows)}\n{int8_note(settings)}\n\n"
    md += f"## The claims, checked against these numbers\n\n{claims}\n"
    paths = [out / "sweep.md", out / "sweep.csv", out / "sweep.json", out / "sweep.png"]
    paths[0].write_text(md)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    record = {
        "settings": settings,
        "rows": [asdict(r) for r in rows],
        "runs": [asdict(r) for r in runs],
        "claims": [asdict(v) for v in found],
    }
    paths[2].write_text(json.dumps(_finite(record), indent=2, allow_nan=False) + "\n")
    plot(rows, paths[3], title)
    return paths
