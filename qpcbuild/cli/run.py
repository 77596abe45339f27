"""Commands that run a bundle: run (smoke test with acceptance statistics), serve, serve-config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from .app import app, emit_json, handles_errors
from .refs import BUNDLE_HELP, InsecureOpt, bundle_folder
from .render import console, err_console

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest

RequireSignatureOpt = typer.Option(None, "--require-signature", metavar="PUBLIC_KEY",
                                   help="Refuse the bundle unless it carries a valid signature "
                                   "by this Ed25519 public key (PEM); see `qpcbuild sign`.")


SpecPolicyOpt = typer.Option(None, "--spec-policy", help="auto (speculate only while faster "
                             "than without) | fixed | off (default: the bundle's).")


def _read_prompts(prompt: Optional[List[str]], prompt_file: Optional[Path]) -> list[str]:
    from ..errors import UsageError
    from ..prompts import check_prompt_text, read_prompt_file

    prompts = list(prompt or []) + (read_prompt_file(prompt_file) if prompt_file else [])
    if not prompts:
        raise UsageError("give --prompt TEXT or --prompt-file FILE")
    for n, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {n} is empty")
        check_prompt_text(p, f"prompt {n}")
    return prompts


# Over 80 lines: 28 of them are Typer option declarations.
@app.command()
@handles_errors
def run(bundle: Path = typer.Argument(..., help=BUNDLE_HELP),
        insecure: bool = InsecureOpt,
        prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="Prompt text "
                                                   "(repeatable: one batch)."),
        prompt_file: Optional[Path] = typer.Option(None, help="One prompt per line ('\\n' for "
                                                   "newlines), or JSONL with a \"prompt\" key; "
                                                   "a line that is a JSON list is refused (text "
                                                   "only, not token ids)."),
        max_new_tokens: int = typer.Option(64, help="New tokens per prompt."),
        temperature: float = typer.Option(0.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0), top_k: int = typer.Option(0),
        seed: Optional[int] = typer.Option(None),
        method: Optional[str] = typer.Option(None, help="draft_model | ngram | suffix | turbo | "
                                             "eagle3 (default: the bundle's)."),
        k: Optional[int] = typer.Option(None, "--k", help="One of the compiled Ks."),
        spec_policy: Optional[str] = SpecPolicyOpt,
        backend: str = typer.Option("onnxruntime", help="onnxruntime | qaic"),
        ctx_len: Optional[int] = typer.Option(None, help="Refuse a bundle not compiled for this "
                                              "ctx_len."),
        batch_size: Optional[int] = typer.Option(None, help="Refuse a bundle not compiled for "
                                                 "this batch size."),
        verify: str = typer.Option("full", help="full | fast (sizes only) | none"),
        require_signature: Optional[Path] = RequireSignatureOpt,
        stream: bool = typer.Option(False, help="Print tokens as they are accepted."),
        compare_baseline: bool = typer.Option(False, help="Also decode target-only and report "
                                              "the speedup and whether outputs match."),
        chat: bool = typer.Option(False, help="Each prompt is a user message put through the "
                                  "bundle's chat template (as vLLM's chat endpoint does)."),
        system: Optional[str] = typer.Option(None, help="System message for --chat."),
        json_out: bool = typer.Option(False, "--json", help="Text, token ids and stats as JSON.")):
    """Run speculative decoding from a bundle (smoke test, with acceptance statistics)."""
    from contextlib import nullcontext

    from ..errors import UsageError
    from ..progress import step
    from .render import show_run
    from ..runtime.loader import load
    from ..runtime.stats import SpecDecodingStats

    prompts = _read_prompts(prompt, prompt_file)
    if max_new_tokens <= 0:
        raise UsageError("--max-new-tokens must be at least 1")
    if system is not None and not chat:
        raise UsageError("--system needs --chat")
    bundle = bundle_folder(bundle, insecure, quiet=json_out,
                           signatures=require_signature is not None)
    gen = load(bundle, backend=backend, method=method, k=k, verify=verify, ctx_len=ctx_len,
               batch_size=batch_size, signed_by=require_signature, policy=spec_policy)
    # Continuous batching takes every prompt at once and refills slots as requests finish.
    batch = len(prompts) if gen.decoder.cb else gen.target.batch_size
    on_token = None
    if stream and not json_out:
        def on_token(row: int, ids: list[int]) -> None:
            console.print(gen.tokenizer.decode(ids), end="", soft_wrap=True, markup=False,
                          highlight=False)
    results, baselines = [], []
    # Progress in generated tokens, counted as the engine commits them, so a log hears from a
    # long decode while it runs (not while streaming: the tokens are the progress, and a bar
    # would cut through them). The total is the most that can come (rows may stop early).
    runs = 2 if compare_baseline else 1
    with nullcontext(lambda n: None) if on_token else step(
            f"decoding {bundle}" + (" (and target-only)" if compare_baseline else ""),
            len(prompts) * max_new_tokens * runs, "tokens") as advance:
        counted = on_token or (lambda row, ids: advance(len(ids)))
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            results.append(gen.generate(chunk, max_new_tokens, temperature, top_k, top_p, seed,
                                        counted, chat=chat, system=system))
            if compare_baseline:
                baselines.append(gen.generate(chunk, max_new_tokens, temperature, top_k, top_p,
                                              seed, None if on_token else counted,
                                              target_only=True, chat=chat, system=system))
    if stream and not json_out:
        console.print()
    report = {"bundle": str(bundle), "backend": backend, "method": gen.method,
              "prompts": prompts, "batches": [r.to_dict() for r in results],
              "total": SpecDecodingStats.merged([r.stats for r in results]).totals_json()}
    handoffs = [r.handoff for r in results if r.handoff is not None]
    if handoffs:  # a disaggregated bundle: the KV that crossed from the prefill process
        report["handoff"] = {"bytes": sum(h["bytes"] for h in handoffs),
                             "seconds": round(sum(h["seconds"] for h in handoffs), 6),
                             "prefill_s": round(sum(h["prefill_s"] for h in handoffs), 6),
                             "per_prompt": [p for h in handoffs for p in h["per_prompt"]],
                             "processes": 2, "transport": handoffs[0]["transport"]}
    numerics = numerics_of(gen.manifest, backend)
    if numerics:  # ONNX Runtime: exact float32, or the card's formats emulated
        report["numerics"] = numerics
    if compare_baseline:
        spd = sum(r.stats.total_s for r in results)
        base = sum(b.stats.total_s for b in baselines)
        same = all(a.rows[i].tokens == b.rows[i].tokens for a, b in zip(results, baselines)
                   for i in range(len(a.rows)))
        report["baseline"] = {"batches": [b.to_dict() for b in baselines],
                              "total": SpecDecodingStats.merged(
                                  [b.stats for b in baselines]).totals_json(),
                              "speedup_e2e": round(base / max(spd, 1e-9), 3),
                              "outputs_match": same if temperature == 0 else None}
    capped = capped_budgets(results, max_new_tokens, gen.decoder.ctx_len)
    if capped:
        report["max_new_tokens_capped"] = capped
        for c in capped:  # said, not silently shortened
            err_console.print(f"note: prompt {c['prompt'] + 1}: --max-new-tokens "
                              f"{max_new_tokens} capped to {c['max_new_tokens']} (the bundle's "
                              f"ctx_len {gen.decoder.ctx_len} less the prompt's "
                              f"{c['prompt_tokens']} tokens)", soft_wrap=True, markup=False)
    if json_out:
        emit_json(report)
    else:
        show_run(report, show_text=not stream)


def capped_budgets(results, max_new_tokens: int, ctx_len: int) -> list[dict]:
    """The prompts whose new-token budget the context cut short: {prompt, prompt_tokens,
    max_new_tokens (what the context left)}."""
    out, index = [], 0
    for result in results:
        for row in result.rows:
            room = ctx_len - len(row.prompt)
            if room < max_new_tokens:
                out.append({"prompt": index, "prompt_tokens": len(row.prompt),
                            "max_new_tokens": room})
            index += 1
    return out


def numerics_of(manifest: Manifest, backend: str) -> dict:
    """Per role run on the host (ONNX Runtime): its artifact's numerics (exact | emulated) and
    formats. Empty for a backend whose numerics are the card's own."""
    from ..backends.onnxruntime.manifest import OrtEntry

    out = {}
    for role, info in manifest.roles.items():
        o = info.backends.get(backend)
        if isinstance(o, OrtEntry):
            out[role] = {"numerics": o.numerics or "exact",
                         **(o.numerics_formats or {"weights": "float32", "kv": "float32"}),
                         "matmul_weights": o.weights}
    return out


@app.command()
@handles_errors
def serve(bundle: Path = typer.Argument(..., help=BUNDLE_HELP),
          insecure: bool = InsecureOpt,
          host: str = typer.Option("127.0.0.1", help="Address to listen on."),
          port: int = typer.Option(8000, help="TCP port."),
          backend: str = typer.Option("onnxruntime", help="onnxruntime | qaic"),
          verify: str = typer.Option("full", help="full | fast (sizes only) | none"),
          require_signature: Optional[Path] = RequireSignatureOpt,
          served_model_name: Optional[str] = typer.Option(
              None, help="Model id clients ask for (default: the bundle's name)."),
          spec_policy: Optional[str] = SpecPolicyOpt,
          log_level: str = typer.Option("info", help="uvicorn log level."),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per request and no "
                                     "throughput lines (the start-up line and errors stay)."),
          stats_interval: float = typer.Option(10.0, help="Seconds between throughput and "
                                               "acceptance lines while requests run (0: none)."),
          prefill_timeout: Optional[float] = typer.Option(
              None, help="A disaggregated bundle: seconds after which a prefill worker that "
              "has not answered is killed and replaced (default 120); its requests get 503.")):
    """OpenAI-compatible server on the bundle (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics with vLLM's metric names)."""
    from ..errors import UsageError
    from ..server import serve as run_server

    if not 0 < port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    folder = bundle_folder(bundle, insecure, signatures=require_signature is not None)
    run_server(folder, host, port, backend, verify, served_model_name, log_level, quiet,
               stats_interval, prefill_timeout, signed_by=require_signature, policy=spec_policy)


@app.command("serve-config")
@handles_errors
def serve_config(bundle: Path = typer.Argument(..., help="Bundle folder."),
                 format: str = typer.Option("vllm", "--format", help="vllm | docker | env | "
                                            "legacy | json | disagg (a disaggregated "
                                            "bundle's two servers)"),
                 image: str = typer.Option("ghcr.io/quic/cloud_ai_inference_vllm:latest",
                                           help="Cloud AI vLLM image for --format docker."),
                 recipe_dir: Optional[Path] = typer.Option(
                     None, help="Folder of the recipe that built the bundle: its relative model "
                     "paths are found from there (default: looked for from here, the bundle's "
                     "parent folders and the shipped recipes/).")):
    """Emit the vLLM (Cloud AI) serve command, env vars or docker line for this bundle."""
    from ..bundle import read_manifest
    from ..errors import UsageError
    from .render import smoke_roles
    from .serve_config import render

    m = read_manifest(bundle)
    if smoke_roles(m):
        raise UsageError(f"{bundle}: holds random smoke weights ({', '.join(smoke_roles(m))}; "
                         "built with --smoke-weights to check the toolchain); a server would "
                         "answer with noise under the real model's name. Build it from the "
                         "real checkpoints to serve it")
    sys.stdout.write(render(m, bundle, format, image, recipe_dir))
