"""C. The f-stage's peak RSS under 1f1b and gpipe."""

from __future__ import annotations

from typing import Any

from .common import HIDDEN, KIB, WIDE, median
from .configs import mlp_toml
from .runner import Runner, Variant, summarise


def memory_section(runner: Runner, model: dict[str, Any], repeats: int, steps: int,
                   wide: dict[str, Any] = WIDE) -> dict[str, Any]:
    """1f1b vs gpipe at M = 8, batch 256: the mlp runs of B, plus a wide split whose activations dominate."""
    m = 8
    batch = wide["batch"]
    width = wide["f"][0][2]
    exp = runner.write_experiment("wide-b256", mlp_toml("wide-b256", wide["f"], wide["g"], batch))
    variants = {sched: Variant(sched, lambda n, sched=sched: runner.distgrad_pair(
        exp, int(n), driver_flags=("--micro-batches", m, "--schedule", sched), expected_s=n * 0.15),
        est_s=0.15, min_steps=steps, max_steps=steps) for sched in ("1f1b", "gpipe")}
    runner.interleave(f"C wide batch {batch} M=8", list(variants.values()), repeats)
    per_mb = (batch // m) * width * 4
    result: dict[str, Any] = {
        "wide": {
            "model": {"f": f"Dense 784->{width} + ReLU", "g": f"Dense {width}->10, softmax CE", "batch": batch,
                      "micro_batches": m},
            "activation_bytes_per_micro_batch": per_mb,
            "expected_held_per_in_flight_micro_batch_bytes": 2 * per_mb,
            "expected_gpipe_minus_1f1b_kib": (m - 2) * 2 * per_mb // KIB,
            "runs": {k: summarise(v) for k, v in variants.items()},
        },
    }
    for name, runs in (("wide", {k: v.samples for k, v in variants.items()}),
                       ("mlp", {s: model.get("256", {}).get("runs", {}).get(f"{s}_m{m}", {}).get("samples", [])
                                for s in ("1f1b", "gpipe")})):
        stats = {}
        for sched, samples in runs.items():
            mems = [s["memory"] for s in samples if "loop_hwm_kib" in s.get("memory", {})]   # >= 2 loop samples
            stats[sched] = {
                "loop_hwm_kib": median([x["loop_hwm_kib"] for x in mems]),
                "loop_max_rss_kib": median([x["loop_max_rss_kib"] for x in mems]),
                "growth_hwm_kib": max((x["growth_hwm_kib"] for x in mems), default=None),
                "growth_rss_kib": max((x["growth_rss_kib"] for x in mems), default=None),
                "final_hwm_kib": median([x["final_hwm_kib"] for x in mems if x.get("final_hwm_kib")]),
                "runs": len(mems),
            }
        a, b = stats.get("1f1b", {}), stats.get("gpipe", {})
        diff = (b["loop_max_rss_kib"] - a["loop_max_rss_kib"]) if a.get("loop_max_rss_kib") and \
            b.get("loop_max_rss_kib") else None
        hwm_diff = (b["loop_hwm_kib"] - a["loop_hwm_kib"]) if a.get("loop_hwm_kib") and b.get("loop_hwm_kib") else None
        result.setdefault(name, {}).update(schedules=stats, gpipe_minus_1f1b_loop_max_rss_kib=diff,
                                           gpipe_minus_1f1b_loop_hwm_kib=hwm_diff)
    result["mlp"]["expected_gpipe_minus_1f1b_kib"] = (m - 2) * 2 * (batch // m) * HIDDEN * 4 // KIB
    return result
