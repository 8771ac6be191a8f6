"""The GPU and TPU suites' report (benchmarks/gpu_suite.py, tpu_suite.py): `markdown(record,
title)`, the tables a person reads, with the targets' verdicts. A module of its own, free
of the suites' flags and of JAX, so that benchmarks/tables.py renders a suite's record in
any process.
"""

from __future__ import annotations

from maelm_jax.infra import markdown as markdown_lib

PROFILE_TOP = 15  # ops per side in the table (all of them in gpu_suite.json)
TARGETS = {"peer": {"mlm": 1.5, "maelm": 1.3, "3ml_self": 1.5, "3ml_cross": 1.5},
           "equal_work_peer": {"mlm": 1.25},
           "mfu": 0.45, "flops_ratio_gap": 0.10, "cold_compile_s": 45.0,
           "cached_compile_s": 5.0, "quickstart_s": 60.0}


def mfu_model(throughput: dict, side: dict) -> float | None:
    """A side's MFU by the model FLOPs (forward + backward = 3 x forward); records from
    before the count was one (no "flops_count") hold 3ML Appendix D's, 2 x forward."""
    if side.get("mfu_flops") is None:
        return None
    return side["mfu_flops"] * (1.0 if throughput.get("flops_count") else 1.5)


def _equal_work(side: dict) -> str:
    """A side's speed over the equal-work peer's, with the target's verdict where one is
    set."""
    ratio = side.get("vs_equal_work_peer")
    if ratio is None:
        return "-"
    target = TARGETS["equal_work_peer"].get(side["objective"])
    verdict = f" ({'meets' if ratio >= target else 'misses'} {target}x)" if target else ""
    return f"{ratio:.2f}x{verdict}"


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _heading(lines: list[str], title: str, record: dict) -> bool:
    """Appends a part's heading, and why it was not measured where it was not; whether it
    was."""
    lines += [f"## {title}", ""]
    if "error" in record or "skipped" in record:
        lines += [f"Not measured: {record.get('error') or record.get('skipped')}", ""]
        return False
    return True


def markdown(results: dict, title: str) -> str:
    """The table a person reads: every part's figures and the targets' verdicts, under
    the heading `title`."""
    lines = [f"# {title}", "", f"Command: `{results['command']}`", ""]
    parts = results["parts"]
    a = parts.get("attention")
    if a:
        measured = _heading(lines, "Attention", a)
        if measured:
            s = a["shape"]
            lines += [f"{a['device']}; B={s['batch']}, L={s['length']}, heads={s['heads']}, "
                      f"head_dim={s['head_dim']}, {a['dtype']}, attention dropout "
                      f"{a['dropout']}.", ""]
            lines += markdown_lib.table(["check", "ok", "detail"], (
                [c["name"], "yes" if c["ok"] else "**no**", c["detail"]] for c in a["checks"]))
            lines.append("")
            lines += markdown_lib.table(["forward + backward", "ms", "TFLOP/s of matmuls"], (
                [name, f"{t['ms']:.2f}", f"{t['matmul_tflops']:.1f}"]
                for name, t in a["timings"].items()))
            lines += ["", f"Fastest correct Pallas options: `{a.get('fastest')}`", ""]
            broken = [v for v in a["variants"] if not v.get("ok")]
            if broken:
                lines += ["Variants not timed: " + "; ".join(
                    f"{v['changes']}: {v.get('error') or v.get('failed')}" for v in broken), ""]
    t = parts.get("throughput")
    if t:
        measured = _heading(lines, "Train step", t)
        if measured:
            lines += [f"{t['device']}; peak {t['peak_tflops']:.0f} TFLOP/s "
                      f"({t['peak_measured_by']}); {t['tokens_per_step']} tokens per step; "
                      f"the peer: {t['peer'] or 'not timed'}; Pallas options "
                      f"`{t['pallas_options']}`.", ""]
            head = ["side", "attention dropout", "compile s", "ms/step", "tokens/s", "vs peer",
                    "vs equal-work peer", "MFU 6NT", "MFU (3 x fwd)", "time / MLM",
                    "FLOPs / MLM"]
            rows = []
            for name, s in t["sides"].items():
                if "error" in s or "skipped" in s:
                    why = s.get("error") or f"not built: {s['skipped']}"
                    rows.append([name, *[markdown_lib.BLANK] * 2, why, *[markdown_lib.BLANK] * 7])
                    continue
                target = TARGETS["peer"].get(s["objective"])
                vs = _fmt(s.get("vs_peer"), ".2f") + ("x" if s.get("vs_peer") else "")
                if target and s.get("vs_peer") is not None:
                    vs += f" ({'meets' if s['vs_peer'] >= target else 'misses'} {target}x)"
                rows.append([name, _fmt(s.get("attention_dropout"), "g"),
                             _fmt(s.get("compile_s"), ".1f"), f"{s['ms']:.2f}",
                             f"{s['tokens_per_s']:.0f}", vs,
                             _equal_work(s), f"{s['mfu_6nt']:.1%}",
                             _fmt(mfu_model(t, s), ".1%"),
                             _fmt(s.get("time_ratio_to_mlm"), ".3f"),
                             _fmt(s.get("flops_ratio_to_mlm"), ".3f")])
            lines += [*markdown_lib.table(head, rows), ""]
    p = parts.get("profile")
    if p:
        measured = _heading(lines, "Profile", p)
        if measured:
            lines += [f"{p['device']}; device time per XLA op, {p['steps']} traced steps; "
                      "the names are the HLO's (profile/<side>.hlo.txt).", ""]
            for name, side in p["sides"].items():
                lines += [f"**{name}**: {side['step_ms']:.2f} ms/step traced, "
                          f"{side['op_ms_per_step']:.2f} ms in ops", ""]
                lines += markdown_lib.table(["op", "ms/step", "share"], (
                    [f"`{o['op']}`", f"{o['ms_per_step']:.3f}", f"{o['share']:.1%}"]
                    for o in side["ops"][:PROFILE_TOP]))
                lines.append("")
    q = parts.get("quickstart")
    if q:
        lines += ["## Quickstart", ""]
        if "seconds" in q and "returncode" in q:
            verdict = "meets" if q["seconds"] <= TARGETS["quickstart_s"] else "misses"
            lines += [f"`{q['command']}`: {q['seconds']:.1f} s, exit {q['returncode']} "
                      f"({verdict} <= {TARGETS['quickstart_s']:.0f} s); last eval: "
                      f"{q.get('last_eval')}", ""]
        else:
            lines += [f"Not measured: {q.get('error') or q.get('skipped')}", ""]
    c = parts.get("compile")
    if c:
        rows = []
        for case in ("cold", "cached", "new_program"):
            r = c.get(case, {})
            rows.append([case, _fmt(r.get("compile_s"), ".1f", r.get("error", "-")),
                         _fmt(r.get("step_ms"), ".2f")])
        lines += ["## Compile", "", *markdown_lib.table(["process", "compile s", "ms/step"], rows)]
        lines += ["", f"Targets: cold <= {TARGETS['cold_compile_s']:.0f} s, cached <= "
                  f"{TARGETS['cached_compile_s']:.0f} s.", ""]
    return "\n".join(lines)
