"""`qpcbuild bench --numerics`: the fp32 target against a lower-precision one, side by side on
ONNX Runtime: the card's mxfp6 weights + mxint8 KV emulated, or (a recipe with
`onnxruntime.target_weights: int8 | int4`) the target's own quantized ORT weights. Acceptance,
tau, the K tune would pick, greedy agreement (first divergence) and logit drift with top-1
agreement (both targets teacher-forced over the fp32 target's greedy output).

It sits above `bench` and `tune` (it uses bench's statistics and tables and tune's decision
model), so that those two need not know each other."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .bench.report import _r, _short, write_outputs
from .backend_api import HOST_BACKEND
from .errors import UsageError
from .runtime.model_session import padded_window
from .recipe.changes import RecipeChanges
from .measuring import (Say, build_for_measurement, default_bench_dir, is_bundle, load_prompts,
                        loadavg, machine_info)
from .runtime.rows import prefill_calls, prefill_feeds
from .runtime.stats import SpecDecodingStats

NUMERICS_SCHEMA = 1
NUMERICS_TUNE_KS = tuple(range(1, 9))  # the Ks `tune` would consider (its default K_max 8)
CARD_FORMATS = {"quantization": "mxfp6", "kv_cache_dtype": "mxint8"}  # recipe.precision's


def _numerics_changes(r) -> tuple[RecipeChanges, RecipeChanges, RecipeChanges]:
    """(common, fp32, emulated) changes to the recipe: both bundles for ONNX Runtime's fused
    graph at batch 1 with float32 draft weights (the card has no int8-draft option); the
    emulated one with the recipe's card formats, or mxfp6 + mxint8 when the recipe asks for
    none."""
    common = RecipeChanges(backends=(HOST_BACKEND,),
                           onnxruntime={"graph": "fused", "draft_weights": "float32",
                                        "draft_block_size": None},
                           shapes={"batch_size": 1, "full_batch_size": None})
    fp32 = RecipeChanges(precision={"quantization": "none", "kv_cache_dtype": "float16"},
                         onnxruntime={"target_weights": "float32", "target_block_size": None})
    p, tw = r.precision, r.onnxruntime.target_weights
    card = {"quantization": p.quantization, "kv_cache_dtype": p.kv_cache_dtype}
    if tw != "float32":  # the recipe's quantized ORT target (and its card formats, if any)
        emu = RecipeChanges(precision=card, onnxruntime={"target_weights": tw})
    elif p.quantization == "none" and p.kv_cache_dtype == "float16":
        emu = RecipeChanges(precision=CARD_FORMATS)
    else:
        emu = RecipeChanges(precision=card)
    return common, fp32, emu


def teacher_forced_logits(gen, prompt: list[int], output: list[int], window: int):
    """The target's logits for each output token given the prompt and the output before it
    ([len(output), vocab]): the prompt in prefill chunks (as the engine sends them), then the
    output in windows of `window` tokens (a compiled verify specialization)."""
    import numpy as np

    t = gen.target
    shapes = gen.manifest.shapes
    for ids, pos, ends in prefill_feeds([prompt], shapes.prefill_seq_len, t.ctx_len,
                                        t.batch_size, tuple(shapes.prefill_tail_seq_lens)):
        logits = t.run(ids, pos)
        if ends[0]:
            last = logits[0, 0].copy()
    rows = [last]
    feed = output[:-1]
    width = padded_window(t, window)  # padded as the engine pads it
    for j in range(0, len(feed), window):
        piece = feed[j:j + window]
        ids = np.zeros((t.batch_size, width), np.int64)
        pos = np.full((t.batch_size, width), -1, np.int64)
        ids[0, :len(piece)] = piece
        pos[0, :len(piece)] = np.arange(len(prompt) + j, len(prompt) + j + len(piece))
        rows.extend(t.run(ids, pos)[0, :len(piece)].copy())
    return np.stack(rows)


def _numerics_column(gen, label: str, prompt_ids, max_new: int, k: int, method: str,
                     costs, say: Say) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy target-only outputs, the SpD run at K (acceptance, tau) and the K `tune` would
    pick from this bundle's acceptance (replayed at every K) and the shared costs."""
    from .tune import choose_k, predict, replayed

    info = gen.manifest.target.backends.get(HOST_BACKEND)
    say(f"{label}: target-only greedy outputs, then {method} at K={k}")
    base = gen.sibling(target_only=True)
    outputs = [base.generate([ids], max_new, temperature=0.0, target_only=True).rows[0]
               for ids in prompt_ids]
    outputs = [r.tokens[len(r.prompt):] for r in outputs]
    gen.fresh_proposer()
    records, prefills = [], 0
    prefill = gen.manifest.shapes.prefill_seq_len
    for ids in prompt_ids:
        records.append(gen.generate([ids], max_new, temperature=0.0, k=k).stats)
        prefills += prefill_calls([ids], prefill)
    st = SpecDecodingStats.merged(records)
    steps = st.target_calls - prefills
    col = {"label": label, "numerics": info.numerics or "exact",
           "formats": info.numerics_formats or {"weights": "float32", "kv": "float32"},
           "target_weights": info.weights,
           "bundle_id": gen.manifest.bundle_id, "k": k, "method": method,
           "acceptance_rate": _r(st.acceptance_rate),
           "acceptance_per_position": [_r(a) for a in st.acceptance_per_position],
           "mean_acceptance_length": _r(st.mean_acceptance_length),
           "tau": _r(st.decode_tokens / steps) if steps > 0 else None,
           "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
           "num_accepted_tokens": st.num_accepted_tokens,
           "new_tokens": st.new_tokens, "target_calls": st.target_calls}
    if costs is not None:
        t_verify, t_draft, host = costs
        ks = [x for x in NUMERICS_TUNE_KS if x in t_verify]
        sims = {x: replayed(gen, prompt_ids, outputs, max_new, x) for x in ks}
        rows = predict(method, {x: sims[x]["alpha"] for x in ks}, t_draft, t_verify, host,
                       {x: sims[x]["proposal_fraction"] for x in ks}, ks)
        col["tune_k"] = choose_k(rows)
        col["tune_table"] = [{key: r[key] for key in ("k", "expected_tokens_per_step",
                                                      "tokens_per_s", "predicted_speedup")}
                             for r in rows]
    return col, outputs


def _host_model(gen, prompt: list[int], max_new_tokens: int):
    """The host time per step of this bundle's loop, from a short run at K=1 and at K=8."""
    from .tune import host_model

    h = {}
    for kk in (1, max(NUMERICS_TUNE_KS)):
        st = gen.generate([prompt], max_new_tokens, temperature=0.0, k=kk).stats
        steps = max(1, st.target_calls - prefill_calls(
            [prompt], gen.manifest.shapes.prefill_seq_len))
        h[kk] = st.host_overhead_s / steps
    return host_model(h)


def run_numerics(fp32_bundle: Path, emu_bundle: Path, prompts: list[str], *, prompt_label: str,
                 k: int, max_new_tokens: int, tune_k: bool = True, rounds: int = 10,
                 say: Say | None = None) -> dict[str, Any]:
    from .runtime.loader import load
    from .tune import measure_costs

    say = say or (lambda m: None)
    machine = machine_info()
    gens = {}
    for label, b in (("fp32", fp32_bundle), ("emulated", emu_bundle)):
        gens[label] = load(b, verify="fast")  # the method each bundle was built for
    g0 = gens["fp32"]
    method = g0.method
    ctx_len = g0.manifest.shapes.ctx_len
    room = ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len {ctx_len}")
    prompt_ids = [g0.encode(p)[-room:] for p in prompts]
    if not all(prompt_ids):
        raise UsageError("a prompt encodes to no tokens")
    notes = []
    costs = None
    if tune_k and all(x in g0.ks for x in NUMERICS_TUNE_KS):
        # Costs are those of this CPU and of the fp32 bundle, shared by both columns: only the
        # acceptance differs between them (the card's own costs are not known here).
        say(f"timing: K draft steps and one K+1 verify for K = 1..{max(NUMERICS_TUNE_KS)}, "
            f"{rounds} rounds (fp32 bundle)")
        position = int(statistics.median(len(p) for p in prompt_ids)) + max_new_tokens // 2
        t_verify, t_draft, _ = measure_costs(g0, list(NUMERICS_TUNE_KS), position, rounds)
        costs = (t_verify, t_draft, None)
    elif tune_k:
        notes.append("tune K omitted: the bundles do not compile K = 1..8")
    columns, outs = [], {}
    for label, gen in gens.items():
        gen.generate([prompt_ids[0]], min(16, max_new_tokens), k=k)  # warm-up, not counted
        col_costs = None if costs is None else \
            (costs[0], costs[1], _host_model(gen, prompt_ids[0], max_new_tokens))
        col, outs[label] = _numerics_column(gen, label, prompt_ids, max_new_tokens, k, method,
                                            col_costs, say)
        columns.append(col)
    # The emulated target against the fp32 one: greedy agreement and logit drift over the
    # fp32 target's own greedy sequence (the same tokens into both).
    columns[1]["greedy_agreement"] = _greedy_agreement(outs["fp32"], outs["emulated"])
    say("logit drift: both targets teacher-forced over the fp32 greedy outputs")
    window = k + 1 if k + 1 in [kk + 1 for kk in g0.ks] else max(g0.ks) + 1
    columns[1]["logit_drift"] = _logit_drift(gens["fp32"], gens["emulated"], prompt_ids,
                                             outs["fp32"], window)
    if costs is None and not tune_k:
        notes.append("tune K not computed (--no-tune-k)")
    if costs is not None:
        notes.append("tune K: acceptance replayed at every K = 1..8 from each bundle's own "
                     "greedy outputs and proposals; call costs measured once on this CPU on the "
                     "fp32 bundle and shared by both columns, so a different K comes from "
                     "acceptance alone (the card's costs differ: run `qpcbuild tune` there)")
    notes.append("logit drift: |emulated - fp32| target logits, both teacher-forced over the "
                 "fp32 target's greedy output (prompt in prefill chunks, then "
                 f"{window}-token windows)")
    if loadavg() is not None:
        machine["loadavg_at_end"] = loadavg()
    from .version import __version__
    return {"schema": NUMERICS_SCHEMA, "tool": "qpcbuild bench --numerics",
            "qpcbuild_version": __version__, "name": g0.manifest.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
            "bundles": {"fp32": str(fp32_bundle), "emulated": str(emu_bundle)},
            "settings": {"prompt_set": prompt_label, "prompts": len(prompt_ids),
                         "prompt_tokens": [len(p) for p in prompt_ids],
                         "max_new_tokens": max_new_tokens, "k": k, "method": method,
                         "greedy": True, "batch_size": 1, "ctx_len": ctx_len,
                         "tau": "new tokens after the first over target verify calls (decode "
                                "steps)"},
            "columns": columns, "notes": notes}


def _greedy_agreement(fp32: list[list[int]], emulated: list[list[int]]) -> dict[str, Any]:
    """Where each prompt's greedy outputs first differ (None: identical)."""
    firsts = []
    for a, b in zip(fp32, emulated):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        firsts.append(n)
    return {"prompts": len(firsts), "identical": sum(f is None for f in firsts),
            "first_divergence": firsts,
            "mean_agreeing_prefix": _r(statistics.fmean(
                len(a) if f is None else f for a, f in zip(fp32, firsts)), 2)}


def _logit_drift(fp32_gen, emulated_gen, prompt_ids: list[list[int]],
                 outputs: list[list[int]], window: int) -> dict[str, Any]:
    """|emulated - fp32| target logits, both teacher-forced over the fp32 greedy `outputs`."""
    import numpy as np

    per_pos_sum, per_pos_n, mx, total, count, top1, top1_n = [], [], 0.0, 0.0, 0, 0, 0
    for ids, out in zip(prompt_ids, outputs):
        if not out:
            continue
        la = teacher_forced_logits(fp32_gen, ids, out, window)
        lb = teacher_forced_logits(emulated_gen, ids, out, window)
        d = np.abs(la.astype(np.float64) - lb)
        mx = max(mx, float(d.max()))
        total += float(d.sum())
        count += d.size
        top1 += int((la.argmax(-1) == lb.argmax(-1)).sum())
        top1_n += len(out)
        for j, row in enumerate(d.mean(axis=-1)):
            if j >= len(per_pos_sum):
                per_pos_sum.append(0.0)
                per_pos_n.append(0)
            per_pos_sum[j] += float(row)
            per_pos_n[j] += 1
    return {"max": _r(mx, 5), "mean": _r(total / count, 6) if count else None,
            "per_position_mean": [_r(s / n, 6) for s, n in zip(per_pos_sum, per_pos_n)],
            "teacher_forced_top1_agreement": _r(top1 / top1_n) if top1_n else None}


def show_numerics(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)  # the CLI passes its own
    s = report["settings"]
    fp, emu = report["columns"]
    t = Table("", fp["label"], emu["label"], title=f"{report['name']}: numerics preview, "
              f"{s['prompts']} prompts ({Path(str(s['prompt_set'])).name}), "
              f"{s['max_new_tokens']} new tokens, {s['method']} K={s['k']}, greedy",
              title_justify="left")
    t.add_row("numerics", column_label(fp), column_label(emu))
    for key, name in (("acceptance_rate", "acceptance rate"),
                      ("mean_acceptance_length", "mean acceptance length"),
                      ("tau", "tau (tokens per target call)")):
        t.add_row(name, str(fp[key]), str(emu[key]))
    t.add_row("per-position acceptance", " ".join(_short(x) for x in fp["acceptance_per_position"]),
              " ".join(_short(x) for x in emu["acceptance_per_position"]))
    if "tune_k" in fp:
        t.add_row("K tune would pick", str(fp["tune_k"]), str(emu["tune_k"]))
    g, d = emu["greedy_agreement"], emu["logit_drift"]
    t.add_row("greedy output = fp32 target", "-",
              f"{g['identical']}/{g['prompts']} prompts; first divergence "
              + ", ".join("-" if f is None else str(f) for f in g["first_divergence"]))
    t.add_row("logit drift vs fp32 (max / mean)", "-", f"{d['max']} / {d['mean']}")
    t.add_row("top-1 agreement, teacher-forced", "-", str(d["teacher_forced_top1_agreement"]))
    console.print(t)
    for n in report["notes"]:
        console.print(f"note: {n}")


def column_label(col: dict[str, Any]) -> str:
    """What a column's target computes with, in words."""
    parts = [] if col["numerics"] == "exact" else [
        f"emulated: weights {col['formats']['weights']}, KV {col['formats']['kv']}"]
    tw = col.get("target_weights", "float32")
    if tw != "float32":
        parts.append(f"ORT target weights {tw} blocks")
    return "; ".join(parts) or "exact float32"


def plot_numerics(report: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp, emu = report["columns"]
    s = report["settings"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    n = max(len(fp["acceptance_per_position"]), len(emu["acceptance_per_position"]))
    xs = list(range(1, n + 1))
    ax1.bar([x - 0.2 for x in xs[:len(fp["acceptance_per_position"])]],
            fp["acceptance_per_position"], width=0.4, label=f"fp32 (tau {fp['tau']})",
            color="#1f77b4")
    ax1.bar([x + 0.2 for x in xs[:len(emu["acceptance_per_position"])]],
            emu["acceptance_per_position"], width=0.4, color="#d62728",
            label=f"{column_label(emu)} (tau {emu['tau']})")
    ax1.set_xticks(xs)
    ax1.set_ylim(0, 1.05)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("accepted / drafts")
    ax1.set_title(f"Per-position acceptance, {s['method']} K={s['k']}")
    ax1.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    drift = emu["logit_drift"]["per_position_mean"]
    ax2.plot(range(len(drift)), drift, color="#d62728", lw=1.5)
    ax2.set_xlabel("output position (teacher-forced on the fp32 greedy output)")
    ax2.set_ylabel("mean |logit emulated - logit fp32|")
    ax2.set_title(f"Logit drift (max {emu['logit_drift']['max']}, mean "
                  f"{emu['logit_drift']['mean']})")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"qpcbuild bench --numerics: {report['name']}, {s['prompts']} prompts, "
                 f"{s['max_new_tokens']} new tokens, greedy", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_numerics(recipe: Path, *, overrides: list[str] = (), prompt_file: Path | None = None,
                   prompt_set: str | None = None, num_prompts: int | None = None,
                   k: int | None = None, max_new_tokens: int = 64, tune_k: bool = True,
                   cache_dir: Path | None = None, bundle_out: Path | None = None,
                   json_out: Path | None = None, plot: Path | None | bool = None,
                   say: Say | None = None) -> tuple[dict[str, Any], Path, Path | None]:
    """Recipe -> two bundles (fp32 and the card's formats emulated) -> report, JSON, PNG."""
    from .recipe import load_recipe

    say = say or (lambda m: None)
    recipe = Path(recipe)
    if is_bundle(recipe) or not recipe.is_file():
        raise UsageError(f"{recipe}: --numerics needs a recipe file (it builds an fp32 and an "
                         "emulated bundle from it)")
    r = load_recipe(recipe, list(overrides))
    if k is None:
        k = max(r.ks)
    if k < 1:
        raise UsageError("--numerics needs a K >= 1")
    common, fp32, emu = _numerics_changes(r)
    ks = sorted(set([0, k, *NUMERICS_TUNE_KS]))
    out = Path(bundle_out) if bundle_out else default_bench_dir(recipe, list(overrides))
    bundles = {}
    for label, extra in (("fp32", fp32), ("emulated", emu)):
        bundles[label] = build_for_measurement(recipe, list(overrides), ks, out / label,
                                               cache_dir, say, changes=common.then(extra))
    label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    report = run_numerics(bundles["fp32"], bundles["emulated"], prompts, prompt_label=label,
                          k=k, max_new_tokens=max_new_tokens, tune_k=tune_k, say=say)
    json_path, png = write_outputs(report, json_out or out / f"numerics-{report['name']}.json",
                                   plot, plot_numerics)
    return report, json_path, png
