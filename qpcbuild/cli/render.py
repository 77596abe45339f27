"""Human-readable views (rich) of the plan, build results and bundles. No decisions here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:  # the plan's imports (onnx, numpy) would slow every command's start
    from ..bundle.manifest import Manifest
    from ..models.arch import ArchSpec
    from ..backend_api import DeclaredIO
    from ..models.specialization import Specialization
    from ..plan import BuildPlan

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
LOG_WIDTH = 10_000  # outside a terminal: wide enough that no table cell is ever cut


def fit_to_output() -> None:
    """On a terminal rich fits lines to its width; in a file or a CI log every line stays
    whole (no wrapped ids or paths, no cells cut to '…')."""
    for c in (console, err_console):
        if not c.is_terminal:
            c.soft_wrap = True
            c.width = LOG_WIDTH


def heading(title: str) -> None:
    """A rule across a terminal; a plain title line in a log."""
    if console.is_terminal:
        console.rule(title)
    else:
        console.print(f"--- {title} ---")


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def _shapes_and_io(specializations: list[Specialization], declared: DeclaredIO) -> None:
    """A unit's specializations and graph I/O (the KV buffers elided past 8 rows)."""
    spec = Table("name", *specializations[0].symbols.keys(), title="specializations",
                 title_justify="left")
    for s in specializations:
        spec.add_row(s.name, *s.symbols.values())
    console.print(spec)
    io = Table("direction", "name", "dtype", "shape", title="graph I/O", title_justify="left")
    for direction in ("inputs", "outputs"):
        items = list(getattr(declared, direction))
        shown = items if len(items) <= 8 else items[:5] + [None] + items[-2:]
        for item in shown:
            if item is None:
                io.add_row("", f"... {len(items) - 7} more KV buffers", "", "")
            else:
                io.add_row(direction[:-1], item.name, item.dtype, str(list(item.shape)))
    console.print(io)


def show_plan(plan: BuildPlan) -> None:
    r = plan.recipe
    console.print(f"[bold]Plan for '{r.name}'[/]  method={plan.method}  K={list(plan.ks)}  "
                  f"backends={r.backends}  output={r.output_dir()}")
    if plan.method_options:
        console.print(f"method options: {plan.method_options}")
    console.print(f"tokenizer alignment: [bold]{plan.tokenizer['verdict']}[/] "
                  f"({plan.tokenizer['detail']})")
    for rp in plan.roles:
        a = rp.arch
        heading(f"[bold]{rp.unit}[/]: {rp.source.ref} ({rp.source.origin})")
        console.print(_kv_table("", [
            ("architecture", f"{a.architecture} ({a.family})"),
            ("parameters", f"{a.param_count:,}"),
            ("layers / heads / kv heads / head_dim", f"{a.num_layers} / {a.num_heads} / "
             f"{a.num_kv_heads} / {a.head_dim}"),
            ("hidden / mlp / vocab", f"{a.hidden_size} / {a.intermediate_size} / {a.vocab_size}"),
            ("rope", f"theta {a.rope_theta:g}, scaling {a.rope_scaling or 'none'}"
             + (f"; sliding layers theta {a.local_rope_theta:g}" if a.has_local_rope else "")),
            *_attention_rows(a),
            ("device group / cores per QID", f"{rp.device_group} / {rp.num_cores}"),
        ]))
        _shapes_and_io(rp.specializations, rp.io)
        for name, part in rp.backends.items():
            for line in part.describe(r, len(rp.device_group), name in r.backends):
                console.print(line)
        console.print("cache keys: " + ", ".join(f"{k} {v}" for k, v in rp.cache_keys.to_dict().items()))
        head = rp.eagle3_head
        if head is not None:  # compiled for the card beside the target, as a unit of its own
            heading(f"[bold]{head.unit}[/]: the EAGLE-3 head on the card (its own QPC)")
            console.print(_kv_table("", [
                ("device group / cores per QID", f"{head.device_group} / {head.num_cores}"),
                ("memory estimate per QID, GiB", f"weights {head.memory.weights_gib:.3f}, "
                 f"KV {head.memory.kv_cache_gib:.3f}")]))
            _shapes_and_io(head.specializations, head.io)
    heading("[bold]cores and memory per QID[/]")
    roles = [rp.role for rp in plan.roles] + \
        ["eagle3_head" for rp in plan.roles if rp.eagle3_head is not None]
    cores = Table("QID", *roles, "free", title="NSP cores", title_justify="left")
    for row in plan.cores_per_qid:
        cores.add_row(str(row["qid"]), *(str(row[x]) for x in roles), str(row["free"]))
    console.print(cores)
    mem = Table("QID", *(f"{x} weights" for x in roles), *(f"{x} KV" for x in roles), "total",
                title=f"memory estimate, GiB (card: {plan.dram_gib_per_qid} GiB per QID; "
                "excludes activations and compiler scratch)", title_justify="left")
    for row in plan.memory_per_qid:
        mem.add_row(str(row["qid"]), *(str(row.get(f"{x}_weights", "-")) for x in roles),
                    *(str(row.get(f"{x}_kv", "-")) for x in roles), str(row["total"]))
    console.print(mem)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def smoke_roles(m: Manifest) -> list[str]:
    return [role for role, info in m.roles.items() if info.source.smoke_weights]


def show_manifest(m: Manifest) -> None:
    from ..backends.qaic.manifest import QaicEntry  # (here: the CLI starts without pydantic)

    spd = m.speculation
    console.print(f"[bold]{m.name}[/]  bundle id {m.bundle_id}")
    smoke = smoke_roles(m)
    if smoke:
        console.print(f"[bold red]RANDOM SMOKE WEIGHTS[/] ({', '.join(smoke)}): built with "
                      "--smoke-weights to check the toolchain; its outputs are noise, never "
                      "serve it")
    console.print(f"method {spd.method}  K={spd.num_speculative_tokens}  "
                  f"shapes {m.shapes.model_dump()}  backends {m.backends}")
    console.print(f"tokenizer: {m.tokenizer.verdict} ({m.tokenizer.detail})")
    t = Table("role", "model", "arch", "params", "specializations", "cores x QIDs", "backends",
              title="roles", title_justify="left")
    for role, info in m.roles.items():
        specs = ", ".join(f"{s.name}({s.symbols['seq_len']})" for s in info.specializations)
        t.add_row(role, info.source.ref, info.arch.architecture,
                  f"{info.arch.param_count:,}", specs,
                  f"{info.num_cores} x {info.device_group}",
                  ", ".join(f"{k}: {v.status}" for k, v in info.backends.items()))
    console.print(t)
    for role, info in m.roles.items():
        q = info.built(QaicEntry)
        if q and q.status == "compiled":
            qpc_bytes = sum(m.files[p].size for p in q.qpc_files or [])
            console.print(f"{role} QPC: {q.qpc} ({len(q.qpc_files or [])} files, "
                          f"{qpc_bytes / 2**20:.1f} MiB)"
                          + (f", log {q.log}" if q.log else ""))
        elif q:
            console.print(f"{role} QPC: not compiled yet; run `bash {q.compile_script}` on a "
                          "machine with the Cloud AI SDK")
        head = q.eagle3_head if q else None
        if head is not None:
            console.print(f"{role} EAGLE-3 head: graph {head.graph}, {head.num_cores} cores x "
                          f"{head.device_group}; QPC "
                          + (f"{head.qpc}" if head.qpc else "not compiled yet (the target's "
                             "compile.sh compiles it)"))
    size = sum(f.size for f in m.files.values())
    console.print(f"{len(m.files)} files, {size / 2**20:.1f} MiB; toolchain: "
                  + ", ".join(f"{k} {v}" for k, v in m.toolchain.items()
                              if isinstance(v, str)))


def _prompt_title(n: int, prompt: str | None) -> str:
    if prompt is None:
        return f"prompt {n}"
    line = " ".join(prompt.split())
    return f"prompt {n}: {line[:48] + '…' if len(line) > 48 else line}"


def show_run(report: dict[str, Any], show_text: bool = True) -> None:
    prompts = report.get("prompts") or []
    n = 0
    for batch in report["batches"]:
        for out in batch["outputs"]:
            if show_text:
                heading(f"{escape(_prompt_title(n, prompts[n] if n < len(prompts) else None))} "
                        f"({out['finish_reason']}, {len(out['token_ids'])} tokens)")
                if console.is_terminal:
                    console.print(out["text"], markup=False, highlight=False)
                else:  # a log gets the text exactly as generated
                    console.file.write(out["text"] + "\n")
            n += 1
    several = len(report["batches"]) > 1
    t = Table("metric", "all prompts" if several else "value", *(["per batch"] if several else []),
              title=f"{report['method']} on {report['backend']}", title_justify="left")
    keys = ("requests", "new_tokens", "ttft_s", "decode_tokens_per_s", "e2e_tokens_per_s",
            "draft_time_s", "target_time_s", "host_overhead_fraction", "target_calls",
            "draft_calls", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "spec_decode_num_accepted_tokens_per_pos")
    total = report.get("total") or report["batches"][0]["stats"]
    for key in keys:
        values = [str(b["stats"][key]) for b in report["batches"]]
        t.add_row(key, str(total[key]), *([", ".join(values)] if several else []))
    console.print(t)
    for role, n in (report.get("numerics") or {}).items():
        console.print(f"{role} numerics: {n['numerics']}" + (
            f" (weights {n['weights']}, KV {n['kv']}; emulated on the CPU)"
            if n["numerics"] == "emulated" else " (float32)") + weights_note(role, n))
    handoff = report.get("handoff")
    if handoff:  # a disaggregated bundle: the prompts' KV came from the prefill process
        console.print(f"KV hand-off: {handoff['bytes']:,} bytes for "
                      f"{len(handoff['per_prompt'])} prompt(s) in {handoff['seconds'] * 1e3:.1f} "
                      f"ms (prefill process {handoff['prefill_s'] * 1e3:.1f} ms; "
                      f"{handoff['transport']})")
    if "baseline" in report:
        b = report["baseline"]
        base_tps = (b.get("total") or b["batches"][0]["stats"])["e2e_tokens_per_s"]
        match = "not applicable (sampling)" if b["outputs_match"] is None else \
            ("yes" if b["outputs_match"] else "no")
        console.print(f"target-only: {base_tps} tokens/s; speedup {b['speedup_e2e']}x; greedy "
                      f"outputs match: {match}")


def weights_note(role: str, numerics: dict) -> str:
    """What a role's quantized matmul weights mean for the output (empty for float32)."""
    fmt = numerics.get("matmul_weights", "float32")
    if fmt == "float32":
        return ""
    effect = "changes proposals only" if role == "draft" else \
        "the OUTPUT differs from the float32 target; see bench --numerics"
    return f"; matmul weights in {fmt} blocks with int8 activations ({effect})"


def _attention_rows(a: ArchSpec) -> list[tuple[str, str]]:
    """Plan rows for what is not Llama's plain block: sliding layers and routed experts."""
    rows = []
    sliding = sum(a.is_sliding(i) for i in range(a.num_layers))
    if sliding:
        rows.append(("sliding-window layers", f"{sliding} of {a.num_layers}, window "
                     f"{a.sliding_window} (masked over the full ctx_len buffer)"))
    if a.num_experts:
        rows.append(("routed layers / experts / per token",
                     f"{len(a.moe_layers)} / {a.num_experts} / {a.experts_per_token}"))
    return rows
