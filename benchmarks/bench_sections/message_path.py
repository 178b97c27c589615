"""A. The message path: raw pyzmq, distgrad's wire path, a real distgrad step and the same model in one
process, per activation size and transport."""

from __future__ import annotations

from typing import Any

from .common import EST_DISTGRAD_SCALE, EST_INPROC_SCALE, MIB, SPIN_SIZES_MAX, SPIN_US, median, ratio
from .configs import trivial_toml
from .runner import Runner, Variant, cores, fmt_size, summarise


def message_path(runner: Runner, sizes: list[int], transports: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        exp = runner.write_experiment(f"trivial-{size}", trivial_toml(size))
        est_dg, est_ip = EST_DISTGRAD_SCALE[size], EST_INPROC_SCALE[size]
        extra = 3.0 * size / 4 / 1e6          # start-up and the summary of N parameters take ~3 s per million
        variants: dict[str, Variant] = {}
        for tr in transports:
            for role in ("raw", "wire"):
                variants[f"{role}-{tr}"] = Variant(
                    f"{role}-{tr}", lambda s, role=role, tr=tr, size=size: runner.round_trip(role, tr, size, s),
                    timed=True)
            for role, script in (("bare", "_bare_identity.py"), ("parts", "_parts_identity.py")):
                variants[f"{role}-{tr}"] = Variant(
                    f"{role}-{tr}", lambda n, tr=tr, size=size, est=est_dg, script=script: runner.bare_identity(
                        tr, size, int(n), n * est, script), est_s=est_dg, min_steps=12 if size >= 64 * MIB else 5)
            small = size <= SPIN_SIZES_MAX
            variants[f"distgrad-{tr}"] = Variant(
                f"distgrad-{tr}", lambda n, tr=tr, exp=exp, est=est_dg, extra=extra, small=small: runner.distgrad_pair(
                    exp, int(n), tr, expected_s=n * est, extra_s=extra, cpu=small),
                est_s=est_dg, min_steps=12 if size >= 64 * MIB else 5)
            if small:
                variants[f"spin-{tr}"] = Variant(
                    f"spin-{tr}", lambda n, tr=tr, exp=exp, est=est_dg: runner.distgrad_pair(
                        exp, int(n), tr, expected_s=n * est, stage_flags=("--spin-us", SPIN_US), cpu=True),
                    est_s=est_dg, min_steps=5)
        variants["inprocess"] = Variant("inprocess", lambda n, exp=exp, est=est_ip, extra=extra: runner.inprocess_api(
            exp, int(n), n * est + extra),
                                        est_s=est_ip, min_steps=5)
        runner.interleave(f"A {fmt_size(size)}", list(variants.values()))
        inproc = variants["inprocess"].t
        row: dict[str, Any] = {"size_bytes": size, "inprocess": summarise(variants["inprocess"]),
                               "inprocess_step_s": inproc}
        for tr in transports:
            raw, wire, dg, bare, parts = (variants[f"{k}-{tr}"].t for k in ("raw", "wire", "distgrad", "bare", "parts"))
            fig: dict[str, Any] = {
                "raw_rt_s": raw, "wire_rt_s": wire, "distgrad_step_s": dg,
                "distgrad_over_raw": ratio(dg, raw), "wire_over_raw": ratio(wire, raw),
                # The floor: the same split written bare (_bare_identity.py), beside the same raw round trip.
                "bare_step_s": bare, "bare_over_raw": ratio(bare, raw), "distgrad_over_bare": ratio(dg, bare),
                "bare": summarise(variants[f"bare-{tr}"]),
                # distgrad's model and wire calls in the same bare loop (_parts_identity.py): what a dedicated
                # lockstep lane made of them could reach, without the driver's and serving stage's protocol.
                "parts_step_s": parts, "parts_over_raw": ratio(parts, raw), "parts": summarise(variants[f"parts-{tr}"]),
                "lockstep_ideal_s": (inproc + raw) if inproc is not None and raw is not None else None,
                "raw": summarise(variants[f"raw-{tr}"]), "wire": summarise(variants[f"wire-{tr}"]),
                "distgrad": summarise(variants[f"distgrad-{tr}"]),
            }
            fig["distgrad_over_lockstep_ideal"] = ratio(dg, fig["lockstep_ideal_s"])
            if f"spin-{tr}" in variants:
                spin = variants[f"spin-{tr}"].t
                fig.update({"spin_us": SPIN_US, "spin_step_s": spin, "spin_over_raw": ratio(spin, raw),
                            "cores": cores(variants[f"distgrad-{tr}"]), "spin_cores": cores(variants[f"spin-{tr}"]),
                            "spin": summarise(variants[f"spin-{tr}"])})
            # The same runs timed between the driver's first and last progress lines (no handshake,
            # no first step, no bye): the steady state, for comparison with elapsed_s / steps.
            fig["distgrad_steady_step_s"] = median([x["steady_t"] for x in variants[f"distgrad-{tr}"].samples
                                                    if "steady_t" in x])
            fig["distgrad_steady_share_of_raw_bytes_per_s"] = ratio(raw, fig["distgrad_steady_step_s"])
            # What a distgrad step spends beyond its wire path and its compute: the stage/daemon logic.
            fig["distgrad_minus_wire_minus_inprocess_s"] = (dg - wire - inproc) if None not in (dg, wire, inproc) \
                else None
            moved = 2 * size                      # activation down, gradient of the same size back
            fig["raw_bytes_per_s"] = moved / raw if raw else None
            fig["distgrad_bytes_per_s"] = moved / dg if dg else None
            fig["wire_bytes_per_s"] = moved / wire if wire else None
            fig["distgrad_share_of_raw_bytes_per_s"] = ratio(raw, dg)
            fig["wire_share_of_raw_bytes_per_s"] = ratio(raw, wire)
            row[tr] = fig
        out[str(size)] = row
    return out
