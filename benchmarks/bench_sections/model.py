"""B. The mlp-classify split (unpipelined, pipelined, in one process, bare, torch gloo) and the balanced
split."""

from __future__ import annotations

from typing import Any

from .common import BALANCED, BenchError, EST_MLP, HIDDEN, SPIN_US, ratio, say
from .configs import mlp_toml
from .runner import Runner, Variant, cores, fmt_time, summarise


def model_section(runner: Runner, batches: list[int], micro_batches: list[int], schedules: list[str],
                  torch_ok: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in batches:
        exp = runner.write_experiment(f"mlp-b{batch}", mlp_toml(f"mlp-classify-b{batch}", [("dense", 784, HIDDEN),
                                                                 ("relu",)], [("dense", HIDDEN, 10)], batch))
        est = EST_MLP[batch]
        frame = batch * HIDDEN * 4
        variants: dict[str, Variant] = {
            "unpipelined": Variant("unpipelined", lambda n, exp=exp, est=est: runner.distgrad_pair(
                exp, int(n), expected_s=n * est, cpu=True), est_s=est),
            "unpipelined_spin": Variant("unpipelined_spin", lambda n, exp=exp, est=est: runner.distgrad_pair(
                exp, int(n), expected_s=n * est, stage_flags=("--spin-us", SPIN_US), cpu=True), est_s=est),
            "inprocess": Variant("inprocess", lambda n, exp=exp, est=est: runner.inprocess_cli(exp, int(n), n * est),
                                 est_s=est / 2),
            "bare": Variant("bare", lambda n, batch=batch, est=est: runner.bare_pair(batch, int(n), n * est),
                            est_s=est),
            "raw_rt": Variant("raw_rt", lambda s, frame=frame: runner.round_trip("raw", "tcp", frame, s), timed=True),
        }
        if torch_ok:
            variants["torch_gloo"] = Variant("torch_gloo", lambda n, batch=batch, est=est: runner.torch_pair(
                batch, int(n), n * est),
                                             est_s=est)
        for m in micro_batches:
            if batch % m or batch == 1:
                continue
            for sched in schedules:
                flags = ("--micro-batches", m, "--schedule", sched)
                variants[f"{sched}_m{m}"] = Variant(
                    f"{sched}_m{m}", lambda n, flags=flags, exp=exp, est=est: runner.distgrad_pair(
                        exp, int(n), driver_flags=flags, expected_s=n * est), est_s=est)
        runner.interleave(f"B mlp batch {batch}", list(variants.values()))
        t = {k: v.t for k, v in variants.items()}
        sps = {k: (1 / x if x else None) for k, x in t.items()}
        ideal_t = (t["inprocess"] + t["raw_rt"]) if t["inprocess"] and t["raw_rt"] else None
        pipelined = {k: x for k, x in sps.items() if ("_m" in k and x)}
        best = max(pipelined, key=pipelined.get) if pipelined else None
        out[str(batch)] = {
            "batch": batch, "frame_bytes": frame,
            "steps_per_s": {k: x for k, x in sps.items() if k != "raw_rt"},
            "raw_rt_s": t["raw_rt"], "lockstep_ideal_steps_per_s": 1 / ideal_t if ideal_t else None,
            "unpipelined_minus_lockstep_ideal_s": (t["unpipelined"] - ideal_t) if t["unpipelined"] and ideal_t
            else None,
            "best_pipelined": best,
            "cores": {"unpipelined": cores(variants["unpipelined"]),
                      "unpipelined_spin": cores(variants["unpipelined_spin"])},
            "ratios": {
                "unpipelined_over_bare": ratio(sps["unpipelined"], sps["bare"]),
                "unpipelined_over_torch_gloo": ratio(sps["unpipelined"], sps.get("torch_gloo")),
                "unpipelined_over_lockstep_ideal": ratio(sps["unpipelined"], 1 / ideal_t if ideal_t else None),
                "unpipelined_spin_over_lockstep_ideal": ratio(sps["unpipelined_spin"],
                                                              1 / ideal_t if ideal_t else None),
                "unpipelined_spin_over_bare": ratio(sps["unpipelined_spin"], sps["bare"]),
                "unpipelined_spin_over_torch_gloo": ratio(sps["unpipelined_spin"], sps.get("torch_gloo")),
                "unpipelined_over_inprocess": ratio(sps["unpipelined"], sps["inprocess"]),
                "best_pipelined_over_unpipelined": ratio(pipelined.get(best), sps["unpipelined"]) if best else None,
                "best_pipelined_over_inprocess": ratio(pipelined.get(best), sps["inprocess"]) if best else None,
            },
            "memory": {k: v.samples[-1].get("memory") for k, v in variants.items()
                       if v.samples and "memory" in v.samples[-1]},
            "runs": {k: summarise(v) for k, v in variants.items()},
        }
    return out


def describe_layers(layers: list[tuple]) -> str:
    """``[("dense", 784, 1024), ("relu",)]`` -> ``"Dense 784->1024 + ReLU"``."""
    return " + ".join(f"Dense {layer[1]}->{layer[2]}" if layer[0] == "dense" else layer[0].capitalize().replace(
        "Relu", "ReLU") for layer in layers)


def balanced_section(runner: Runner, micro_batches: list[int], schedules: list[str],
                     batch: int = BALANCED["batch"], spec: dict[str, Any] = BALANCED) -> dict[str, Any]:
    name = f"balanced-b{batch}"
    exp = runner.write_experiment(name, mlp_toml(name, spec["f"], spec["g"], batch))
    compute = {}
    for m in [1, *micro_batches]:
        try:
            compute[m] = runner.stage_compute(exp, m)
        except BenchError as e:
            runner.failures.append({"group": "balanced", "variant": f"stage-compute m{m}", "repeat": "0",
                                    "error": str(e)})
    if 1 in compute:
        c = compute[1]
        say(f"balanced split, isolated compute per batch: f {fmt_time(c['f_forward_backward_s'])}, "
            f"g {fmt_time(c['g_forward_loss_backward_s'])}, updates {fmt_time(c['f_update_s'])} / "
            f"{fmt_time(c['g_update_s'])}")
    est = 0.02 * batch / 256
    variants: dict[str, Variant] = {
        "unpipelined": Variant("unpipelined", lambda n: runner.distgrad_pair(exp, int(n), expected_s=n * est),
                               est_s=est),
        "inprocess": Variant("inprocess", lambda n: runner.inprocess_cli(exp, int(n), n * est), est_s=est),
    }
    for m in micro_batches:
        for sched in schedules:
            flags = ("--micro-batches", m, "--schedule", sched)
            variants[f"{sched}_m{m}"] = Variant(
                f"{sched}_m{m}", lambda n, flags=flags: runner.distgrad_pair(exp, int(n), driver_flags=flags,
                                                                             expected_s=n * est), est_s=est)
    runner.interleave(f"B balanced batch {batch}", list(variants.values()))
    sps = {k: (1 / v.t if v.t else None) for k, v in variants.items()}
    ceilings = {}
    if 1 in compute:
        c1 = compute[1]
        unsplit = (c1["f_forward_backward_s"] + c1["g_forward_loss_backward_s"] + c1["f_update_s"]
                   + c1["g_update_s"])
        for m in micro_batches:
            if m in compute:
                cm = compute[m]
                fm, gm = cm["f_forward_backward_s"], cm["g_forward_loss_backward_s"]
                piped = m * max(fm, gm) + min(fm, gm) + cm["f_update_s"] + cm["g_update_s"]
                ceilings[str(m)] = {"f_per_micro_batch_s": fm, "g_per_micro_batch_s": gm, "g_over_f": gm / fm,
                                    "split_compute_over_unsplit": m * (fm + gm) / (c1["f_forward_backward_s"]
                                                                                  + c1["g_forward_loss_backward_s"]),
                                    "compute_only_speedup_estimate": unsplit / piped}
    return {
        "model": {"f": describe_layers(spec["f"]), "g": f"{describe_layers(spec['g'])}, softmax CE", "batch": batch},
        "stage_compute": {str(k): v for k, v in compute.items()},
        "compute_only_estimates": ceilings,
        "steps_per_s": sps,
        "ratios": {
            **{f"{k}_over_unpipelined": ratio(x, sps["unpipelined"]) for k, x in sps.items() if "_m" in k},
            **{f"{k}_over_inprocess": ratio(x, sps["inprocess"]) for k, x in sps.items() if "_m" in k},
            "unpipelined_over_inprocess": ratio(sps["unpipelined"], sps["inprocess"]),
        },
        "memory": {k: v.samples[-1].get("memory") for k, v in variants.items()
                   if v.samples and "memory" in v.samples[-1]},
        "runs": {k: summarise(v) for k, v in variants.items()},
    }
