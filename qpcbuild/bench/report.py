"""The bench report: built from the measurements (a JSON-able dict of the user's results only),
then written as JSON, shown as tables and written as a markdown table (plot.py draws it).

Where each number comes from is written into the report's `settings` (tokens/s: wall time of
our generate calls on this machine's ONNX Runtime sessions; speedup: over the same run's
target-only; ideal speedup: the measured per-call costs and acceptance put into the SpD cost
formula)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from .bandwidth import bandwidth_line
from ..errors import UsageError
from ..measuring import loadavg
from .contention import CpuSnapshot, judge, snapshot
from ..runtime.rates import acceptance_rate
from .records import Measure

REPORT_SCHEMA = 1


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, nd)


def _row(meas: Measure, base: Measure, ref_outputs: list[list[list[int]]]) -> dict[str, Any]:
    tps = meas.tps()
    mean, std = _mean_std(tps)
    ratios = [t / b for t, b in zip(tps, base.tps()) if b > 0]
    sp_mean = mean / statistics.fmean(base.tps()) if mean and base.tps() else None
    _, sp_std = _mean_std(ratios)
    same = None
    if meas.outputs and ref_outputs:
        same = all(o == ref_outputs[0] for o in meas.outputs)
    row = {"system": meas.system, "method": meas.method, "k": meas.k, "label": meas.label,
           "tokens_per_s": {"mean": _r(mean, 2), "std": _r(std, 2),
                            "per_repeat": [_r(t, 2) for t in tps]},
           "speedup": {"mean": _r(sp_mean, 3), "std": _r(sp_std, 3)},
           "new_tokens_per_repeat": meas.tokens[0] if meas.tokens else None,
           "seconds_per_repeat": [_r(s, 4) for s in meas.seconds],
           "greedy_matches_target_only": same}
    if meas.error:
        row["error"] = meas.error
    if meas.skipped:
        row["skipped"] = meas.skipped
    st, eng = meas.stats, meas.engine
    if meas.system == "qpcbuild" and eng is not None:
        row.update({
            "acceptance_rate": _r(eng.acceptance_rate),
            "mean_acceptance_length": _r(eng.mean_acceptance_length),
            "acceptance_per_position": [_r(a) for a in eng.acceptance_per_position],
            "num_drafts": eng.num_drafts, "num_draft_tokens": eng.num_draft_tokens,
            "num_accepted_tokens": eng.num_accepted_tokens,
            "target_calls": eng.target_calls, "draft_calls": eng.draft_calls,
            "target_time_s": _r(eng.target_s), "draft_time_s": _r(eng.draft_s),
            "host_overhead_fraction": _r(eng.host_overhead_fraction) if eng.total_s else None,
        })
        figures = eng.speculation
        if figures is not None:  # a gated row (docs/adaptive.md)
            row["gate"] = {"steps_with_speculation": figures.steps_with_speculation,
                           "steps_without_speculation": figures.steps_without_speculation,
                           "shadow_checks": figures.shadow_checks,
                           "policy_switches": len(figures.policy_switches)}
        dec, bdec = decode_figures(meas), decode_figures(base)
        if dec and bdec:
            row["decode_tokens_per_s"] = _r(dec["tokens_per_s"], 2)
            row["decode_speedup"] = _r(dec["tokens_per_s"] / bdec["tokens_per_s"], 3)
        if meas.method == "draft_model" and dec and bdec and eng.draft_calls and \
                meas.label.endswith(f"K={meas.k}"):  # a fixed K: gated rows have no one ideal
            # Over decode steps only (prefill is the same for every configuration and not part
            # of the speculation's economics). The draft's per-call time includes its prefill
            # chunks, so the ideal is slightly pessimistic for the draft.
            t_base = bdec["target_s_per_call"]
            t_spd = dec["target_s_per_call"]
            t_draft = eng.draft_s / eng.draft_calls
            ideal = dec["tokens_per_step"] * t_base / (meas.k * t_draft + t_spd)
            row["ideal_speedup"] = _r(ideal, 3)
            row["measured_over_ideal"] = _r(row["decode_speedup"] / ideal, 3) \
                if row.get("decode_speedup") and ideal else None
            row["cost_per_call_ms"] = {"target_only_target": _r(t_base * 1e3),
                                       "spd_target": _r(t_spd * 1e3), "draft": _r(t_draft * 1e3)}
    elif st:
        row["peer_stats"] = dict(st)
        if st.get("draft_tokens_proposed"):
            row["acceptance_rate"] = _r(acceptance_rate(st["draft_tokens_accepted"],
                                                        st["draft_tokens_proposed"]))
    return row


def _decoding(settings: dict) -> str:
    t = settings.get("temperature") or 0.0
    return f"sampled at temperature {t:g}" if t else "greedy"


def decode_figures(meas: Measure) -> dict[str, float] | None:
    """Decode-phase figures of our summed engine statistics: after each request's first token
    (the prefill time is the target prefill and the first token; decode steps are the target
    calls that are not prefill chunks)."""
    eng = meas.engine
    if eng is None:
        return None
    steps = eng.target_calls - meas.prefill_calls
    if steps <= 0 or eng.decode_s <= 0 or eng.decode_tokens <= 0:
        return None
    return {"tokens_per_s": eng.decode_tokens_per_s, "tokens_per_step": eng.decode_tokens / steps,
            "target_s_per_call": (eng.target_s - eng.prefill_s) / steps}


def _best(rows: list[dict], pred: Callable[[dict], bool]) -> dict | None:
    cands = [r for r in rows if pred(r) and r["tokens_per_s"]["mean"] and not r.get("error")]
    return max(cands, key=lambda r: r["tokens_per_s"]["mean"]) if cands else None


# Over 80 lines: one JSON record assembled field by field, in the order the report lists them.
def build_report(bundle, manifest, prompt_label, prompt_ids, prompts, max_new, repeats, ks, methods,
            ours, peer_objs, notes, gen, machine, bandwidth=None,
            sampled: bool = False, cpu_start: CpuSnapshot | None = None) -> dict[str, Any]:
    from ..version import __version__, code_version

    base = ours[0][0]
    ref = None if sampled else base.outputs  # sampled outputs differ from run to run
    rows = [_row(m, base, ref) for m, _ in ours]
    peers_out = {}
    all_peer_rows = []
    for p in peer_objs:
        prow = [_row(m, base, ref) for m, _ in p.cases]
        all_peer_rows += prow
        peers_out[p.name] = {"status": p.status, "note": p.note, "version": p.version,
                             "info": p.info, "rows": prow}
    ratios = []
    for p in peer_objs:
        for method in ("target_only", "draft_model", "ngram"):
            mine = _best(rows, lambda r, m=method: r["method"] == m)
            theirs = _best(peers_out[p.name]["rows"], lambda r, m=method: r["method"] == m)
            if mine and theirs:
                ratios.append({"peer": p.name, "method": method, "ours": mine["label"],
                               "theirs": theirs["label"],
                               "ours_over_theirs": round(mine["tokens_per_s"]["mean"]
                                                         / theirs["tokens_per_s"]["mean"], 3)})
        mine = _best(rows, lambda r: True)
        theirs = _best(peers_out[p.name]["rows"], lambda r: True)
        if mine and theirs:
            ratios.append({"peer": p.name, "method": "best", "ours": mine["label"],
                           "theirs": theirs["label"],
                           "ours_over_theirs": round(mine["tokens_per_s"]["mean"]
                                                     / theirs["tokens_per_s"]["mean"], 3)})

    label = manifest.target_weights_label()
    if label:  # every row runs this target, the baseline included
        notes.insert(0, label)
    if loadavg() is not None:
        machine["loadavg_at_end"] = loadavg()
    base_tps = base.tps()
    spread = statistics.pstdev(base_tps) / statistics.fmean(base_tps) \
        if len(base_tps) > 1 and statistics.fmean(base_tps) > 0 else 0.0
    contention, reasons = judge(cpu_start, snapshot(), spread)
    noisy = bool(reasons)
    if noisy:
        notes.append("the machine was not quiet: " + "; ".join(reasons) + " (target-only "
                     "tokens/s by repeat: " + ", ".join(f"{t:,.0f}" for t in base_tps) + "); "
                     "compare configurations within a repeat (per_repeat) or run again")
    machine["threads"] = {"qpcbuild_target": getattr(gen.target, "threads", None),
                          "qpcbuild_draft": getattr(gen.draft, "threads", None)}
    return {
        "schema": REPORT_SCHEMA, "tool": "qpcbuild bench", "qpcbuild_version": __version__,
        "code_version": code_version(), "bundle": report_path(bundle),
        "bundle_id": manifest.bundle_id, "name": manifest.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "settings": {"prompt_set": prompt_label, "prompts": len(prompt_ids),
                     "prompt_tokens": [len(p) for p in prompt_ids], "max_new_tokens": max_new,
                     "repeats": repeats, "warmup": "one prompt per configuration, not counted",
                     "interleaving": "per repeat: every configuration runs over all prompts "
                                     "in turn",
                     "gc": "cyclic garbage collection off inside timed calls, run between "
                           "them (as timeit does)",
                     "ks": ks, "methods": methods, "greedy": True,
                     "target_weights": manifest.target.matmul_weights(),
                     "batch_size": manifest.shapes.batch_size,
                     "ctx_len": manifest.shapes.ctx_len,
                     "prefill_seq_len": manifest.shapes.prefill_seq_len,
                     "prefill_tail_seq_lens": manifest.shapes.prefill_tail_seq_lens,
                     "compiled_ks": list(manifest.ks),
                     "target_only_k": base.k,
                     "tokens_per_s": "new tokens / wall time of the generate calls (prefill "
                                     "included); mean and std over repeats",
                     "speedup": "tokens/s over the same run's qpcbuild target-only tokens/s",
                     "decode_speedup": "decode phase only (after the first token): decode "
                                       "tokens/s over target-only decode tokens/s",
                     "ideal_speedup": "draft_model, decode steps only: (tokens per verify step) "
                                      "x (target-only time per target call) / (K x draft time "
                                      "per draft call + SpD target time per target call); "
                                      "measured_over_ideal = decode_speedup / ideal_speedup"},
        "baseline": rows[0],
        "rows": rows,
        "all_greedy_outputs_match": all(r["greedy_matches_target_only"] is not False
                                        for r in rows),
        "noisy": noisy, "noisy_because": reasons, "contention": contention,
        "target_only_spread": round(spread, 4),
        "target_only_bandwidth": bandwidth,
        "peers": peers_out,
        "ratios": ratios,
        "notes": notes + ["each ngram/suffix configuration starts with a fresh proposer in each "
                          "repeat (suffix decoding's cross-request cache holds only the earlier "
                          "prompts of that pass)"],
    }


def report_path(path: Path | str) -> str:
    """A path as a report records it: relative to the working directory where it lies under
    it, else its last component alone (a report names no folder of the machine it ran on)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.name


def default_json_path(bundle: Path, manifest_name: str) -> Path:
    bundle = Path(bundle).resolve()
    return bundle.parent / f"bench-{manifest_name}.json"


def write_json(report: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # nothing half-written stays behind
        tmp.unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write the report ({exc.strerror or exc})") from None
    return path


def write_outputs(report: dict[str, Any], json_path: Path, plot: Path | None | bool,
                  plotter: Callable[[dict[str, Any], Path], Path]) -> tuple[Path, Path | None]:
    """The JSON report, and the plot (plot False: none; a path; None: next to the JSON)."""
    json_path = write_json(report, json_path)
    png = None
    if plot is not False:
        try:
            png = plotter(report, plot if isinstance(plot, Path) else json_path.with_suffix(".png"))
        except ImportError as exc:
            report["notes"].append(f"no plot: matplotlib is not installed ({exc}); it is in "
                                   "the bench extra: pip install -e '.[bench]' (or --no-plot)")
            write_json(report, json_path)
    return json_path, png


def _fmt(mean, std, digits=0, suffix="") -> str:
    if mean is None:
        return "-"
    return f"{mean:,.{digits}f}{suffix}" + (f" ±{std:,.{digits}f}" if std else "")


def _short(x: float) -> str:
    """0.93 -> '.93', 1.0 -> '1.00' (per-position columns stay narrow)."""
    text = f"{x:.2f}"
    return text[1:] if text.startswith("0") else text


def show_report(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)  # the CLI passes its own
    s = report["settings"]
    m = report["machine"]
    title = (f"{report['name']}: {s['prompts']} prompts ({s['prompt_set']}), {s['max_new_tokens']} "
             f"new tokens, {_decoding(s)}, {s['repeats']} repeats  |  {m['cpu']} "
             f"x{m['cpu_count']}" + _weights_tag(s))
    t = Table("method", "K", "tokens/s", "speedup", "decode x", "accept", "mean len",
              "per-position acceptance", "ideal", "meas/ideal", "host", "= target", title=title,
              title_justify="left")
    for r in report["rows"]:
        pp = r.get("acceptance_per_position") or []
        tag = f"K={r['k']} "  # gated rows: "draft_model K=4 auto p_min=0.5"
        gated = r["label"].split(tag, 1)[1] if tag in r["label"] else ""
        t.add_row(f"{r['method']} {gated}".strip(), str(r["k"]),
                  _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
                  _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
                  "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x",
                  "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}",
                  "-" if r.get("mean_acceptance_length") is None
                  else f"{r['mean_acceptance_length']:.2f}",
                  " ".join(_short(x) for x in pp) or "-",
                  "-" if r.get("ideal_speedup") is None else f"{r['ideal_speedup']:.2f}x",
                  "-" if r.get("measured_over_ideal") is None
                  else f"{r['measured_over_ideal']:.0%}",
                  "-" if r.get("host_overhead_fraction") is None
                  else f"{r['host_overhead_fraction']:.0%}",
                  {True: "[green]yes[/]", False: "[red]NO[/]", None: "-"}[
                      r["greedy_matches_target_only"]])
    console.print(t)
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            console.print(f"[yellow]peer {name}: {p['status']}[/] - {p['note']}")
            continue
        pt = Table("configuration", "tokens/s", "vs our target-only", "accept", "= our tokens",
                   title=f"peer: {name} {p['version'] or ''}  {p['note']}", title_justify="left")
        for r in p["rows"]:
            pt.add_row(r["label"], _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
                       _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
                       "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}",
                       r.get("error") or r.get("skipped")
                       or {True: "yes", False: "no", None: "-"}[r["greedy_matches_target_only"]])
        console.print(pt)
    if report["ratios"]:
        rt = Table("peer", "method", "ours (best)", "theirs (best)", "ours / theirs",
                   title="tokens/s ratios, best configuration of each", title_justify="left")
        for x in report["ratios"]:
            rt.add_row(x["peer"], x["method"], x["ours"], x["theirs"],
                       f"{x['ours_over_theirs']:.2f}x")
        console.print(rt)
    if report.get("target_only_bandwidth"):
        console.print(bandwidth_line(report["target_only_bandwidth"]))
    if not report["all_greedy_outputs_match"]:
        console.print("[red]greedy outputs differ from target-only for some configuration[/]")
    for n in report["notes"]:
        console.print(f"note: {n}")


def _weights_tag(settings: dict) -> str:
    """The title's mark of a quantized target (every row, target-only included, runs it)."""
    fmt = settings.get("target_weights")
    return "" if fmt in (None, "float32") else f"  |  {fmt.upper()} TARGET (not float32)"


def markdown_table(report: dict[str, Any]) -> str:
    """Per method and K: tokens/s, speedup, acceptance, ideal vs measured, host overhead."""
    tag = _weights_tag(report["settings"])
    lines = [f"target: {tag.split('|', 1)[1].strip()}", ""] if tag else []
    lines += ["| method | K | tokens/s | speedup | decode speedup | acceptance | mean acc. len | "
              "ideal (decode) | measured/ideal | host overhead | = target-only |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append("| " + " | ".join([
            r["method"], str(r["k"]), _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
            _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
            "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x",
            "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.3f}",
            "-" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}",
            "-" if r.get("ideal_speedup") is None else f"{r['ideal_speedup']:.2f}x",
            "-" if r.get("measured_over_ideal") is None else f"{r['measured_over_ideal']:.0%}",
            "-" if r.get("host_overhead_fraction") is None
            else f"{r['host_overhead_fraction']:.1%}",
            str(r["greedy_matches_target_only"])]) + " |")
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            lines.append(f"\n{name}: {p['status']} ({p['note']})")
            continue
        lines += ["", f"**{name} {p['version']}** ({p['note']})", "",
                  "| configuration | tokens/s | vs our target-only | = our target-only |",
                  "|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['label']} | {_fmt(r['tokens_per_s']['mean'], r['tokens_per_s']['std'])}"
                         f" | {_fmt(r['speedup']['mean'], r['speedup']['std'], 2, 'x')} | "
                         f"{r.get('error') or r.get('skipped') or r['greedy_matches_target_only']} |")
    if report["ratios"]:
        lines += ["", "| peer | method | ours | theirs | ours / theirs |", "|---|---|---|---|---|"]
        lines += [f"| {x['peer']} | {x['method']} | {x['ours']} | {x['theirs']} | "
                  f"{x['ours_over_theirs']:.2f}x |" for x in report["ratios"]]
    if report.get("target_only_bandwidth"):
        lines += ["", bandwidth_line(report["target_only_bandwidth"])]
    return "\n".join(lines)
