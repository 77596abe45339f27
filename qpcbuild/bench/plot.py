"""The bench report's plot: speedup vs K per method (peers on the same scale) and acceptance vs K."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..toolchain import HOST_RUNTIME


# Over 80 lines: one figure drawn panel by panel; splitting it would pass the axes around.
def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Two panels: speedup vs K per method (error bars: std over repeats; peers in thin dashed
    lines on the same scale: their tokens/s over our target-only), and acceptance vs K."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"draft_model": "#1f77b4", "ngram": "#2ca02c", "suffix": "#d62728"}
    peer_style = {"transformers": ("o", ":"), "onnxruntime-genai": ("s", "--")}
    rows = report["rows"]
    ks = report["settings"]["ks"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6))
    ours_h, peers_h = [], []
    ours_h.append(ax1.axhline(1.0, color="black", lw=1.2, label="qpcbuild target-only (= 1)"))
    for method in report["settings"]["methods"]:
        pts = sorted((r for r in rows if r["method"] == method
                      and r["speedup"]["mean"] is not None), key=lambda r: r["k"])
        if not pts:
            continue
        ours_h.append(ax1.errorbar([r["k"] for r in pts], [r["speedup"]["mean"] for r in pts],
                                   yerr=[r["speedup"]["std"] or 0 for r in pts],
                                   color=colors.get(method), marker="o", capsize=3, lw=2.2,
                                   label=f"qpcbuild {method}"))
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            continue
        marker, ls = peer_style.get(name, ("x", "-."))
        for r in p["rows"]:
            if r["k"] is None and r["speedup"]["mean"] is not None:  # no K: a reference line
                color = "gray" if r["method"] == "target_only" else colors.get(r["method"])
                peers_h.append(ax1.axhline(r["speedup"]["mean"], color=color, ls=ls, lw=1,
                                           alpha=0.8, label=f"{name} {r['label']}"))
        for method in ("draft_model", "ngram"):
            pts = sorted((r for r in p["rows"] if r["method"] == method and r["k"] is not None
                          and r["speedup"]["mean"] is not None), key=lambda r: r["k"])
            kind = "assisted / draft" if method == "draft_model" else "n-gram / lookup"
            if pts:
                peers_h.append(ax1.plot([r["k"] for r in pts], [r["speedup"]["mean"] for r in pts],
                                        color=colors.get(method), marker=marker, ls=ls, lw=1.2,
                                        mfc="none", alpha=0.85,
                                        label=f"{name} {kind}")[0])
    ax1.set_xlabel("K (speculative tokens per step)")
    ax1.set_ylabel("speedup over qpcbuild target-only (tokens/s ratio)")
    ax1.set_title("Speedup vs K (error bars: std over repeats)")
    ax1.set_xticks(ks)
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.legend(handles=ours_h + peers_h, fontsize=8, loc="upper center",
               bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax2b = ax2.twinx()
    acc_h = []
    for method in report["settings"]["methods"]:
        pts = sorted((r for r in rows if r["method"] == method
                      and r.get("acceptance_rate") is not None), key=lambda r: r["k"])
        if not pts:
            continue
        acc_h += ax2.plot([r["k"] for r in pts], [r["acceptance_rate"] for r in pts],
                          color=colors.get(method), marker="o", lw=2,
                          label=f"{method}: acceptance rate")
        acc_h += ax2b.plot([r["k"] for r in pts], [r["mean_acceptance_length"] for r in pts],
                           color=colors.get(method), marker="^", ls="--", lw=1.5,
                           label=f"{method}: mean acceptance length")
    ax2.set_xlabel("K (speculative tokens per step)")
    ax2.set_ylabel("acceptance rate (accepted / proposed), solid")
    ax2b.set_ylabel("mean acceptance length (tokens per step), dashed")
    ax2.set_ylim(0, 1.05)
    ax2b.set_ylim(bottom=1)
    ax2.set_xticks(ks)
    ax2.grid(alpha=0.3)
    ax2.set_title("Acceptance vs K")
    ax2.legend(handles=acc_h, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12),
               ncol=2, frameon=False)
    s, m = report["settings"], report["machine"]
    base_tps = report["baseline"]["tokens_per_s"]["mean"]
    load = m.get("loadavg_at_start", ["?"])[0]
    fig.suptitle(f"qpcbuild bench: {report['name']}, {s['prompts']} prompts "
                 f"({Path(str(s['prompt_set'])).name}), {s['max_new_tokens']} new tokens, greedy, "
                 f"repeats={s['repeats']}; qpcbuild target-only {base_tps:,.0f} tokens/s\n"
                 f"{m['cpu']}, {m['cpu_count']} CPUs, {HOST_RUNTIME} {m.get(HOST_RUNTIME)}, "
                 f"load average {load} at start", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit below the axes
    plt.close(fig)
    return path
