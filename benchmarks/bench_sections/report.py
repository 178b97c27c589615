"""The targets (ratios against the goals of docs/performance.md) and the printed tables."""

from __future__ import annotations

from typing import Any, Callable, TextIO

from .common import BALANCED, KIB, MIB, SPIN_US, ratio
from .runner import fmt_rate, fmt_ratio, fmt_size, fmt_time


def all_memory(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every distgrad pair run's f-stage memory figures (B and C)."""
    out = []
    for section in (results.get("model", {}).values(), [results.get("balanced", {}), results.get("balanced_big_batch", {})],
                    [results.get("memory", {}).get("wide", {})]):
        for block in section:
            for run in block.get("runs", {}).values():
                out += [s["memory"] for s in run.get("samples", []) if "loop_hwm_kib" in s.get("memory", {})]
    return out


def targets(results: dict[str, Any], transports: list[str]) -> list[dict[str, Any]]:
    """Every figure next to its target; ``limited_by`` says what bounds it, with the figures that show it."""
    rows: list[dict[str, Any]] = []

    def add(name: str, figure: float | None, target: str, ok: bool | None, limit: str) -> None:
        rows.append({"target": name, "figure": figure, "wanted": target,
                     "met": None if figure is None else ok, "limited_by": limit})

    def add_floor(name: str, figure: float | None, target: str, meets: Callable[[float], bool]) -> None:
        """What the bare split of the same model reaches against the same target: not distgrad's figure, but
        whether this machine lets any split meet the target (``met`` is the floor's)."""
        add(name, figure, target, figure is not None and meets(figure),
            "the floor: the same split written bare, without distgrad's protocol (_bare_identity.py)")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.0f}%"

    mp = results.get("message_path", {})
    for size in (4, 4 * KIB):
        for tr in transports:
            r = mp.get(str(size), {}).get(tr, {})
            x = r.get("distgrad_over_raw")
            add(f"small message {fmt_size(size)} {tr}: distgrad step / raw round trip", x, "<= 1.6x",
                x is not None and x <= 1.6,
                f"latency: the wire path alone is {fmt_ratio(r.get('wire_over_raw'))} raw "
                f"({fmt_time(r.get('wire_rt_s'))} vs {fmt_time(r.get('raw_rt_s'))}); compute "
                f"{fmt_time(mp.get(str(size), {}).get('inprocess_step_s'))}; the bare split (the floor) "
                f"{fmt_ratio(r.get('bare_over_raw'))} raw, distgrad's model and wire calls in that loop "
                f"{fmt_ratio(r.get('parts_over_raw'))}")
            add_floor(f"small message {fmt_size(size)} {tr}: bare lockstep split / raw round trip (the floor)",
                      r.get("bare_over_raw"), "<= 1.6x", lambda v: v <= 1.6)
            x = r.get("spin_over_raw")
            if x is not None:
                add(f"small message {fmt_size(size)} {tr} with --spin-us {r['spin_us']}: distgrad step / raw round trip",
                    x, "<= 1.6x", x <= 1.6,
                    f"latency; CPU: both stage processes busy {fmt_ratio(r.get('spin_cores'))} cores with the spin "
                    f"vs {fmt_ratio(r.get('cores'))} without ({fmt_time(r.get('spin_step_s'))} vs "
                    f"{fmt_time(r.get('distgrad_step_s'))} per step)")
    for size in (4 * MIB, 64 * MIB):
        for tr in transports:
            r = mp.get(str(size), {}).get(tr, {})
            x = r.get("distgrad_share_of_raw_bytes_per_s")
            ip, raw = mp.get(str(size), {}).get("inprocess_step_s"), r.get("raw_rt_s")
            ceiling = ratio(raw, (ip + raw) if ip is not None and raw is not None else None)
            add(f"large message {fmt_size(size)} {tr}: distgrad bytes/s / raw bytes/s", x, ">= 0.6",
                x is not None and x >= 0.6,
                f"compute on the critical path: the model's own step is {fmt_time(ip)} vs raw {fmt_time(raw)}, so "
                f"even a free transport gets {pct(ceiling)}; wire path alone "
                f"{pct(r.get('wire_share_of_raw_bytes_per_s'))}; step / (compute + raw) "
                f"{fmt_ratio(r.get('distgrad_over_lockstep_ideal'))}; the bare split (the floor) "
                f"{pct(ratio(raw, r.get('bare_step_s')))}")
            add_floor(f"large message {fmt_size(size)} {tr}: bare lockstep split bytes/s / raw bytes/s (the floor)",
                      ratio(raw, r.get("bare_step_s")), ">= 0.6", lambda v: v >= 0.6)
    model = results.get("model", {})
    b32 = model.get("32", {})
    sps = b32.get("steps_per_s", {})
    x = b32.get("ratios", {}).get("unpipelined_over_bare")
    add("mlp batch 32: unpipelined / bare raw-frame numpy split", x, ">= 0.9", x is not None and x >= 0.9,
        f"latency: {fmt_time(ratio(1, sps.get('unpipelined')))} vs {fmt_time(ratio(1, sps.get('bare')))} per step; "
        f"distgrad's framing, validation and step logic vs none")
    x = b32.get("ratios", {}).get("unpipelined_over_torch_gloo")
    add("mlp batch 32: unpipelined / torch gloo split", x, ">= 2.0", x is not None and x >= 2.0,
        f"latency: torch gloo {fmt_time(ratio(1, sps.get('torch_gloo')))} per step vs distgrad "
        f"{fmt_time(ratio(1, sps.get('unpipelined')))}" if sps.get("torch_gloo") else "torch not available")
    x = b32.get("ratios", {}).get("unpipelined_spin_over_bare")
    add(f"mlp batch 32 with --spin-us {SPIN_US}: unpipelined / bare raw-frame numpy split", x, ">= 0.9",
        x is not None and x >= 0.9,
        f"latency; CPU: {fmt_ratio(b32.get('cores', {}).get('unpipelined_spin'))} cores busy with the spin vs "
        f"{fmt_ratio(b32.get('cores', {}).get('unpipelined'))} without")
    for batch in ("1", "32"):
        b = model.get(batch, {})
        x = b.get("ratios", {}).get("unpipelined_over_lockstep_ideal")
        add(f"mlp batch {batch}: unpipelined / lockstep ideal (in-process + one raw round trip)", x, ">= 0.85",
            x is not None and x >= 0.85,
            f"latency: {fmt_time(b.get('unpipelined_minus_lockstep_ideal_s'))} per step over the ideal; the bare "
            f"split reaches "
            f"{fmt_ratio(ratio(b.get('steps_per_s', {}).get('bare'), b.get('lockstep_ideal_steps_per_s')))} of it")
        x = b.get("ratios", {}).get("unpipelined_spin_over_lockstep_ideal")
        add(f"mlp batch {batch} with --spin-us {SPIN_US}: unpipelined / lockstep ideal", x, ">= 0.85",
            x is not None and x >= 0.85,
            f"latency; CPU: {fmt_ratio(b.get('cores', {}).get('unpipelined_spin'))} cores busy with the spin vs "
            f"{fmt_ratio(b.get('cores', {}).get('unpipelined'))} without")
    for bal in (results.get("balanced", {}), results.get("balanced_big_batch", {})):
        est = bal.get("compute_only_estimates", {})
        batch = bal.get("model", {}).get("batch", BALANCED["batch"])
        for key in sorted(k for k in bal.get("ratios", {}) if k.endswith("_over_unpipelined")):
            m = key.split("_m")[1].split("_")[0]
            if int(m) >= 4:
                x = bal["ratios"][key]
                e = est.get(m, {})
                add(f"balanced split batch {batch}, {key.split('_over')[0]}: pipelined / unpipelined", x, ">= 1.6x",
                    x is not None and x >= 1.6,
                    f"compute: split into {m}, the stages' compute costs "
                    f"{fmt_ratio(e.get('split_compute_over_unsplit'))} the unsplit batch; isolated compute alone "
                    f"allows {fmt_ratio(e.get('compute_only_speedup_estimate'))}; two stages overlapping perfectly "
                    f"allow at most 2M/(M+1) = {fmt_ratio(2 * int(m) / (int(m) + 1))}")
    x = model.get("256", {}).get("ratios", {}).get("best_pipelined_over_inprocess")
    add("mlp batch 256: best pipelined / in-process (one thread)", x, ">= 1.0", x is not None and x >= 1.0,
        "compute: f holds almost all of it (784x256 vs 256x10), nothing to overlap")
    bal = results.get("balanced", {})      # batch 256, not the batch-1024 run the loop above ended on
    best = max((v for k, v in bal.get("ratios", {}).items() if k.endswith("_over_inprocess") and "_m" in k and v),
               default=None)
    add("balanced split batch 256: best pipelined / in-process (one thread)", best, ">= 1.0",
        best is not None and best >= 1.0,
        f"compute: unpipelined is {fmt_ratio(bal.get('ratios', {}).get('unpipelined_over_inprocess'))} in-process; "
        f"pipelining does not pay back its splitting cost")
    wide = results.get("memory", {}).get("wide", {})
    diff, expected = wide.get("gpipe_minus_1f1b_loop_hwm_kib"), wide.get("expected_gpipe_minus_1f1b_kib")
    add("memory, wide split M=8 batch 256: f-stage peak (VmHWM) gpipe - 1f1b, KiB", diff,
        f"~{expected} (6 more micro-batches in flight)", diff is not None and expected is not None
        and 0.5 * expected <= diff <= 2 * expected,
        "the schedule's window: gpipe keeps 8 micro-batches' activations, 1f1b 2")
    mems = all_memory(results)
    growth = max((m["growth_hwm_kib"] for m in mems), default=None)
    add("memory, every distgrad run of B and C: largest f-stage VmHWM rise after 10% of the loop, KiB", growth,
        "<= 2048 (no growth over steps)", growth is not None and growth <= 2048,
        f"{len(mems)} runs of {min((m['steps'] for m in mems), default=0)} to "
        f"{max((m['steps'] for m in mems), default=0)} steps; buffers are per step")
    return rows




def format_table(rows: list[list[str]], markdown: bool = False) -> str:
    """Aligned plain-text columns, or a Markdown table."""
    if markdown:
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(results: dict[str, Any], transports: list[str], out: TextIO, markdown: bool = False) -> None:
    """Print every section's table and the targets (as Markdown with ``markdown``)."""
    def table(rows: list[list[str]]) -> str:
        return format_table(rows, markdown)

    mp = results.get("message_path")
    if mp:
        print("\nA. Message path (per step: activation down, gradient of the same size back)", file=out)
        rows = [["size", "tr", "raw rt", "wire rt", "distgrad step", "(steady)", "in-proc step", "dg/raw",
                 "wire/raw", "bare step", "bare/raw", "parts/raw", "dg/(inproc+raw)", "raw MB/s", "dg MB/s", "dg share", "wire share",
                 f"spin {SPIN_US}us step", "spin/raw", "cores (spin)"]]
        for size, row in mp.items():
            for tr in transports:
                r = row.get(tr, {})
                big = int(size) >= 4 * MIB
                rows.append([fmt_size(int(size)), tr, fmt_time(r.get("raw_rt_s")), fmt_time(r.get("wire_rt_s")),
                             fmt_time(r.get("distgrad_step_s")), fmt_time(r.get("distgrad_steady_step_s")),
                             fmt_time(row.get("inprocess_step_s")),
                             fmt_ratio(r.get("distgrad_over_raw")), fmt_ratio(r.get("wire_over_raw")),
                             fmt_time(r.get("bare_step_s")), fmt_ratio(r.get("bare_over_raw")),
                             fmt_ratio(r.get("parts_over_raw")),
                             fmt_ratio(r.get("distgrad_over_lockstep_ideal")),
                             f"{r['raw_bytes_per_s'] / 1e6:.0f}" if big and r.get("raw_bytes_per_s") else "",
                             f"{r['distgrad_bytes_per_s'] / 1e6:.0f}" if big and r.get("distgrad_bytes_per_s") else "",
                             f"{r['distgrad_share_of_raw_bytes_per_s'] * 100:.0f}%"
                             if big and r.get("distgrad_share_of_raw_bytes_per_s") else "",
                             f"{r['wire_share_of_raw_bytes_per_s'] * 100:.0f}%"
                             if big and r.get("wire_share_of_raw_bytes_per_s") else "",
                             fmt_time(r.get("spin_step_s")) if "spin_step_s" in r else "",
                             fmt_ratio(r.get("spin_over_raw")) if "spin_step_s" in r else "",
                             f"{fmt_ratio(r.get('cores'))} ({fmt_ratio(r.get('spin_cores'))})"
                             if "spin_step_s" in r else ""])
        print(table(rows), file=out)
    model = results.get("model")
    if model:
        print("\nB. mlp-classify split, steps/s (tcp)", file=out)
        keys = sorted({k for b in model.values() for k in b["steps_per_s"]},
                      key=lambda k: (k not in ("unpipelined", "inprocess", "bare", "torch_gloo"), k))
        rows = [["variant", *[f"batch {b}" for b in model]]]
        for k in keys:
            rows.append([k, *[fmt_rate(b["steps_per_s"].get(k)) for b in model.values()]])
        rows.append(["lockstep ideal", *[fmt_rate(b["lockstep_ideal_steps_per_s"]) for b in model.values()]])
        rows.append(["raw rt (frame)", *[f"{fmt_time(b['raw_rt_s'])} ({fmt_size(b['frame_bytes'])})"
                                         for b in model.values()]])
        for rk in ("unpipelined_over_bare", "unpipelined_over_torch_gloo", "unpipelined_over_lockstep_ideal",
                   "unpipelined_spin_over_bare", "unpipelined_spin_over_torch_gloo",
                   "unpipelined_spin_over_lockstep_ideal",
                   "unpipelined_over_inprocess", "best_pipelined_over_unpipelined", "best_pipelined_over_inprocess"):
            rows.append([rk.replace("_over_", " / "), *[fmt_ratio(b["ratios"].get(rk)) for b in model.values()]])
        for ck in ("unpipelined", "unpipelined_spin"):
            rows.append([f"cores busy, {ck}", *[fmt_ratio(b.get("cores", {}).get(ck)) for b in model.values()]])
        rows.append(["best pipelined", *[b["best_pipelined"] or "-" for b in model.values()]])
        print(table(rows), file=out)
    for bal in (results.get("balanced"), results.get("balanced_big_batch")):
        if not bal:
            continue
        print(f"\nB'. Balanced split at batch {bal['model']['batch']} ({bal['model']['f']} | {bal['model']['g']}), "
              f"steps/s", file=out)
        rows = [["variant", "steps/s", "/ unpipelined", "/ in-process"]]
        for k, x in bal["steps_per_s"].items():
            rows.append([k, fmt_rate(x), fmt_ratio(ratio(x, bal["steps_per_s"].get("unpipelined"))),
                         fmt_ratio(ratio(x, bal["steps_per_s"].get("inprocess")))])
        print(table(rows), file=out)
        for m, c in bal.get("compute_only_estimates", {}).items():
            print(f"  M={m}: isolated compute per micro-batch f {fmt_time(c['f_per_micro_batch_s'])}, "
                  f"g {fmt_time(c['g_per_micro_batch_s'])} (g/f {c['g_over_f']:.2f}); splitting costs "
                  f"{c['split_compute_over_unsplit']:.2f}x the unsplit compute; compute-only speedup estimate "
                  f"{c['compute_only_speedup_estimate']:.2f}x", file=out)
    mem = results.get("memory")
    if mem:
        print("\nC. f-stage memory, M=8, batch 256 (KiB)", file=out)
        rows = [["model", "schedule", "loop VmHWM", "loop max RSS", "VmHWM growth", "RSS growth",
                 "final VmHWM"]]
        for name in ("mlp", "wide"):
            for sched, s in mem.get(name, {}).get("schedules", {}).items():
                rows.append([name, sched, *[str(s.get(k)) if s.get(k) is not None else "-"
                                            for k in ("loop_hwm_kib", "loop_max_rss_kib", "growth_hwm_kib",
                                                      "growth_rss_kib", "final_hwm_kib")]])
        print(table(rows), file=out)
        for name in ("mlp", "wide"):
            s = mem.get(name, {})
            print(f"  {name}: gpipe - 1f1b loop max RSS {s.get('gpipe_minus_1f1b_loop_max_rss_kib')} KiB, "
                  f"VmHWM {s.get('gpipe_minus_1f1b_loop_hwm_kib')} KiB (6 more micro-batches in flight: "
                  f"~{s.get('expected_gpipe_minus_1f1b_kib')} KiB)", file=out)
    rows = [["target", "figure", "wanted", "met", "limited by"]]
    for t in results.get("targets", []):
        fig = t["figure"]
        rows.append([t["target"], "-" if fig is None else f"{fig:.3g}", t["wanted"],
                     {True: "met", False: "NOT met", None: "-"}[t["met"]], t["limited_by"]])
    print("\nTargets", file=out)
    print(table(rows), file=out)
