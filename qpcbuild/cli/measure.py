"""Commands that measure: bench (side by side with peers, or the numerics preview) and tune."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .app import RecipeArg, SetOpt, app, emit_json, handles_errors, progress_line
from .render import console, err_console


# Options bench and tune share (the prompts they measure on).
PromptsOpt = typer.Option(None, "--prompts", help="Prompt file: JSONL with a \"prompt\" (or "
                          "\"text\") key, or one prompt per line (default: a shipped set); "
                          "a JSON-list line is refused (text, not token ids).")
PromptSetOpt = typer.Option(None, "--prompt-set", help="Shipped prompts: code | echo | prose "
                            "(default: code).")
NumPromptsOpt = typer.Option(None, "--num-prompts", help="Use the first N prompts only.")
MaxNewTokensOpt = typer.Option(128, help="New tokens per prompt.")
VerifyOpt = typer.Option("full", "--verify", help="Check the bundle before measuring: full "
                         "(SHA-256 of every file) | fast (sizes only) | none.")


def _print_report(report: dict, show, json_path: Path, png: Optional[Path],
                  json_stdout: bool) -> None:
    if json_stdout:
        emit_json(report)
        return
    show(report, console)
    console.print(f"JSON report: {json_path}" + (f"; plot: {png}" if png else ""))


# Over 80 lines: 49 of them are Typer option declarations; the body is 38.
@app.command()
@handles_errors
def bench(target: Path = typer.Argument(..., help="Bundle folder, or a recipe: then a bench "
                                        "bundle with Ks 0..8 (or 0 and --ks) is built first, "
                                        "exports from the cache."),
          set_: Optional[List[str]] = SetOpt,
          prompts: Optional[Path] = PromptsOpt,
          prompt_set: Optional[str] = PromptSetOpt,
          num_prompts: Optional[int] = NumPromptsOpt,
          ks: Optional[str] = typer.Option(None, "--ks", help="Ks to measure: 1-8, 1,2,4 "
                                           "(default: every compiled K > 0)."),
          methods: Optional[str] = typer.Option(None, "--methods", help="Comma list of "
                                                "draft_model, ngram, suffix, turbo, eagle3 "
                                                "(default: all the bundle supports)."),
          max_new_tokens: int = MaxNewTokensOpt,
          repeats: int = typer.Option(3, min=1, help="Measured repeats (a warm-up pass comes "
                                      "first and is not counted)."),
          peers: str = typer.Option("transformers,onnxruntime-genai",
                                    help="Peers to run when installed (comma list), or 'none'. "
                                    "llama.cpp and vLLM are measured from a checkout: "
                                    "benchmarks/peers/run.py."),
          peer_ks: Optional[str] = typer.Option(None, "--peer-ks", help="Ks for the peers' "
                                                "speculative decoding (default: --ks)."),
          cache_dir: Optional[Path] = typer.Option(None, help="Build cache (also holds the "
                                                   "onnxruntime-genai models of the peers)."),
          bundle_dir: Optional[Path] = typer.Option(None, "--bundle-dir", help="Where a recipe's "
                                                    "bench bundle goes (default: its output + "
                                                    "'-bench')."),
          json_out: Optional[Path] = typer.Option(None, "--json-out", help="JSON report (default: "
                                                  "bench-<name>.json next to the bundle)."),
          plot: Optional[Path] = typer.Option(None, "--plot", help="PNG plot (default: the JSON "
                                              "path with .png). Needs matplotlib, in the bench "
                                              "extra: pip install -e '.[bench]'."),
          no_plot: bool = typer.Option(False, "--no-plot", help="Skip the plot."),
          json_stdout: bool = typer.Option(False, "--json", help="Print the JSON report instead "
                                           "of the tables."),
          chat: bool = typer.Option(False, "--chat", help="Each prompt is a user message, "
                                    "rendered with the bundle's chat template."),
          numerics: bool = typer.Option(False, "--numerics", help="Numerics preview (a recipe): "
                                        "fp32 against the card's mxfp6 weights + mxint8 KV "
                                        "emulated on the CPU, or against the recipe's "
                                        "onnxruntime.target_weights (int8/int4), side by "
                                        "side: acceptance, tau, the "
                                        "K tune would pick, greedy agreement, logit drift "
                                        "(--ks: the K to run, default the recipe's largest)."),
          spec_policy: str = typer.Option("fixed", "--spec-policy", help="Comma list of "
                                          "speculation policies to measure per method and K: "
                                          "fixed, auto (goodput-gated), off."),
          draft_p_min: Optional[float] = typer.Option(None, "--draft-p-min", help="Confidence "
                                                      "stop for the draft_model and eagle3 "
                                                      "rows of non-fixed policies (0..1)."),
          temperature: float = typer.Option(0.0, help="Sampling temperature of our runs (seeded "
                                            "per prompt batch; > 0: outputs are not compared)."),
          verify: str = VerifyOpt):
    """Measure every method and K of a bundle, target-only, and the installed peers side by side."""
    from importlib.util import find_spec

    from ..bench import bench as run_bench, find_peer, parse_ks, show_report
    from ..errors import UsageError

    if plot is not None and not no_plot and find_spec("matplotlib") is None:  # before the work
        raise UsageError(f"--plot {plot}: needs matplotlib, which is not installed; it is in the "
                         "bench extra: pip install -e '.[bench]' (or leave out --plot)")
    if numerics:
        from ..numerics_bench import bench_numerics, show_numerics

        chosen = parse_ks(ks)
        if chosen is not None and len(chosen) != 1:
            raise UsageError("--numerics runs one K: give --ks K")
        report, json_path, png = bench_numerics(
            target, overrides=set_ or [], prompt_file=prompts, prompt_set=prompt_set,
            num_prompts=num_prompts, k=chosen[0] if chosen else None,
            max_new_tokens=max_new_tokens, cache_dir=cache_dir, bundle_out=bundle_dir,
            json_out=json_out, plot=False if no_plot else plot, say=progress_line)
        _print_report(report, show_numerics, json_path, png, json_stdout)
        return
    peer_list = tuple(p.strip() for p in peers.split(",") if p.strip() and p.strip() != "none")
    for name in peer_list:  # before a recipe's bench bundle is built (minutes)
        find_peer(name)
    policies = _policies(spec_policy)
    if draft_p_min is not None and not 0 <= draft_p_min <= 1:
        raise UsageError(f"--draft-p-min must be in 0..1, got {draft_p_min}")
    if not (temperature >= 0 and temperature < float("inf")):
        raise UsageError(f"--temperature must be a finite number >= 0, got {temperature}")
    report, json_path, png = run_bench(
        target, overrides=set_ or [], prompt_file=prompts, prompt_set=prompt_set,
        num_prompts=num_prompts, ks=parse_ks(ks),
        methods=[m.strip() for m in methods.split(",") if m.strip()] if methods else None,
        max_new_tokens=max_new_tokens, repeats=repeats, peers=peer_list,
        peer_ks=parse_ks(peer_ks), cache_dir=cache_dir, bundle_out=bundle_dir,
        json_out=json_out, plot=False if no_plot else plot, say=progress_line,
        policies=policies, draft_p_min=draft_p_min, temperature=temperature, chat=chat,
        verify=verify)
    _print_report(report, show_report, json_path, png, json_stdout)
    if not report["all_greedy_outputs_match"]:
        bad = [r["label"] for r in report["rows"] if r["greedy_matches_target_only"] is False]
        err_console.print(f"[red]error:[/] greedy outputs differ from target-only for: "
                          f"{', '.join(bad)} (see {json_path})")
        raise typer.Exit(1)


def _policies(text: str) -> tuple[str, ...]:
    from ..errors import UsageError
    from ..runtime.policy import POLICIES

    chosen = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in chosen if p not in POLICIES]
    if bad or not chosen:
        raise UsageError(f"--spec-policy: {', '.join(bad) or 'nothing'} given; use a comma list "
                         f"of {', '.join(POLICIES)}")
    return chosen


@app.command()
@handles_errors
def tune(recipe: Path = RecipeArg, set_: Optional[List[str]] = SetOpt,
         k_max: int = typer.Option(8, "--k-max", help="Largest K to consider (calibration runs "
                                   "at K_max)."),
         prompts: Optional[Path] = PromptsOpt,
         prompt_set: Optional[str] = PromptSetOpt,
         num_prompts: Optional[int] = NumPromptsOpt,
         max_new_tokens: int = MaxNewTokensOpt,
         rounds: int = typer.Option(20, min=3, help="Timed calls per K for the cost medians."),
         cache_dir: Optional[Path] = typer.Option(None, help="Build cache (default: the user "
                                                  "cache dir, or $QPCBUILD_CACHE)."),
         write: Optional[Path] = typer.Option(None, "--write", help="Write the recipe with the "
                                              "chosen K and the evidence as comments to this "
                                              "file."),
         in_place: bool = typer.Option(False, "--in-place", help="Rewrite the recipe's "
                                       "num_speculative_tokens line (other lines are kept)."),
         json_out: bool = typer.Option(False, "--json", help="Print the evidence and decision "
                                       "as JSON."),
         cost_model: bool = typer.Option(False, "--cost-model", help="Call costs from a roofline "
                                         "model of the recipe's card (shapes, precision, the "
                                         "card's published bandwidth and fp16 compute per QID) "
                                         "instead of timing them here; acceptance is measured "
                                         "as always."),
         card_bandwidth_gbs: Optional[float] = typer.Option(None, "--card-bandwidth-gbs",
                                                            help="With --cost-model: DRAM GB/s "
                                                            "per QID (default: the card's "
                                                            "published figure)."),
         card_tflops: Optional[float] = typer.Option(None, "--card-tflops", help="With "
                                                     "--cost-model: fp16 TFLOPS per QID "
                                                     "(default: the card's published figure)."),
         per_batch: Optional[str] = typer.Option(None, "--per-batch", help="Batch sizes (1,2,4 "
                                                 "or 1-4): the best K for each too, recorded "
                                                 "in the evidence."),
         force: bool = typer.Option(False, "--force", help="Write the recipe even when the "
                                    "model check disagrees with the prediction."),
         verify: str = VerifyOpt):
    """Pick K from measured acceptance and costs (expected tokens per second), and record why."""
    from dataclasses import replace

    from ..errors import UsageError
    from ..bench import parse_ks
    from ..prompts import check_output_file
    from ..recipe import load_recipe
    from ..tune import show_tune, tune as run_tune, write_tuned_recipe
    from ..tune.report import disagreements, refuse_if_contradicted

    if write is not None and in_place:
        raise UsageError("give --write FILE or --in-place, not both")
    check_output_file(write, "--write")
    result = disagreements(run_tune(recipe, set_ or [], k_max=k_max, prompt_file=prompts,
                      prompt_set=prompt_set, num_prompts=num_prompts,
                      max_new_tokens=max_new_tokens, rounds=rounds, cache_dir=cache_dir,
                      say=progress_line, cost_model=cost_model,
                      card_bandwidth_gbs=card_bandwidth_gbs, card_tflops=card_tflops,
                      per_batch=parse_ks(per_batch), verify=verify))
    written = None
    refused = bool(result.model_check_disagrees) and not force and \
        (write is not None or in_place)
    if (write is not None or in_place) and not refused:
        written = write_tuned_recipe(recipe, result, None if in_place else write)
        result = replace(result, written=str(written), written_value=load_recipe(
            written).speculation.num_speculative_tokens)
        if set_:
            err_console.print("[yellow]note:[/] only num_speculative_tokens was written; the "
                              f"--set overrides used while measuring ({', '.join(set_)}) were "
                              "not")
    if json_out:
        emit_json(result.to_json())
    else:
        show_tune(result, console)
    if refused:
        refuse_if_contradicted(result, force, "--force", "the recipe was not written")
