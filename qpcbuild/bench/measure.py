"""Our measurement: every method and K of a bundle and target-only, the peers' cases beside them,
repeats interleaved; and `bench`, the entry point (bundle or recipe -> report, JSON, plot)."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from ..prompts import check_output_file
from ..runtime import suffix_tree
from ..recipe import CONFIDENT_METHODS, METHODS
from ..runtime.policy import ConfidenceStop
from ..runtime.rows import prefill_calls
from ..measuring import (BENCH_KS, Say, build_for_measurement,
                         default_bench_dir, is_bundle, load_prompts, machine_info)
from .contention import snapshot
from .memory_turns import MemoryTurns
from .peers import find_peer
from .records import Measure

DEFAULT_PEERS = ("transformers", "onnxruntime-genai")
SLOW_PEER_FRACTION = 0.25  # a peer configuration slower than this x its target-only is skipped


def _our_runner(gen, method: str, k: int | None, batch: int, max_new: int,
                policy: str | None = None, temperature: float = 0.0) -> Callable:
    target_only = method == "target_only"
    prefill = gen.manifest.shapes.prefill_seq_len

    def run(prompt_ids: list[list[int]], acc: Measure | None) -> tuple[list, int, float]:
        outs, tokens, seconds = [], 0, 0.0
        for start in range(0, len(prompt_ids), batch):
            chunk = prompt_ids[start:start + batch]
            t0 = time.perf_counter()
            res = gen.generate(chunk, max_new, temperature=temperature, target_only=target_only,
                               k=None if target_only else k, seed=start if temperature else None,
                               policy=None if target_only else policy)
            seconds += time.perf_counter() - t0
            for row in res.rows:
                outs.append(row.tokens[len(row.prompt):])
            tokens += res.stats.new_tokens
            if acc is not None:
                acc.add_engine(res.stats, prefill_calls(chunk, prefill))
        return outs, tokens, seconds
    return run


# Over 80 lines: its checks of the arguments against the bundle's manifest come first; they stay
# here, where the typed Manifest work (issue 29, item 1) rewrites those reads.
def run_bench(bundle: Path, prompts: list[str], *, prompt_label: str = "", ks: list[int] | None
              = None, methods: list[str] | None = None, max_new_tokens: int = 128,
              repeats: int = 3, peers: tuple[str, ...] = DEFAULT_PEERS,
              peer_ks: list[int] | None = None, cache_dir: Path | None = None,
              say: Say | None = None,
              model_paths: dict[str, Path] | None = None,
              policies: tuple[str, ...] = ("fixed",), draft_p_min: float | None = None,
              temperature: float = 0.0, chat: bool = False,
              verify: str = "full") -> dict[str, Any]:
    """Measure and return the report (a JSON-able dict). `model_paths`: each role's local
    checkpoint for the peers (a bundle records models by reference only, not by path). `chat`:
    each prompt is a user message, rendered with the bundle's chat template. verify: as
    `load`'s; a bundle is measured only once every byte is checked, by default."""
    from ..bundle import read_manifest
    from ..runtime.loader import load
    from .bandwidth import make_probe, target_only_bandwidth
    from .report import build_report, decode_figures

    say = say or (lambda m: None)
    bundle = Path(bundle)
    manifest = read_manifest(bundle)  # with model_paths (in memory only: peers load from there)
    manifest = manifest.with_model_paths({role: path for role, path in (model_paths or {}).items()
                                          if role in manifest.roles})
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if repeats < 1:
        raise UsageError("--repeats must be at least 1")
    compiled = sorted(manifest.ks)
    supported = [m for m in METHODS if (m != "draft_model" or manifest.draft is not None)
                 and (m != "turbo" or manifest.speculation.turbo_heads)
                 and (m != "eagle3" or manifest.speculation.method == "eagle3")]
    methods = list(methods or supported)
    for m in methods:
        if m not in supported:
            raise UsageError(f"method '{m}' is not supported by this bundle (supported: "
                             f"{', '.join(supported)})")
    ks = list(ks) if ks is not None else [k for k in compiled if k > 0]
    missing = [k for k in ks if k not in compiled]
    if missing:
        raise UsageError(f"K {missing} not compiled in {bundle} (compiled: {compiled}); bench a "
                         "recipe instead to build every K, or pick --ks from the compiled ones")
    ks = [k for k in ks if k > 0]
    if not ks:
        raise UsageError("no K >= 1 to measure")
    peer_ks = list(peer_ks) if peer_ks is not None else ks

    machine = machine_info()  # the load average now, before this run adds to it
    cpu_start = snapshot()  # the machine's CPU counters, to tell others' use from ours
    # One Generator per method, all over the same sessions (one target, one draft): a method
    # is only a different proposer in front of them.
    base = load(bundle, method=methods[0], verify=verify)
    gens = {m: base if m == methods[0] else base.sibling(m) for m in methods}
    gen = base
    batch = gen.target.batch_size
    ctx_len = manifest.shapes.ctx_len
    room = ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len {ctx_len}")
    prompt_ids, truncated = _encode_prompts(gen, prompts, chat, room)
    notes = ["prompts rendered as chat turns with the bundle's chat template"] if chat else []
    if truncated:
        notes.append(f"{truncated} prompt(s) cut to their last {room} tokens so that prompt + "
                     f"{max_new_tokens} new tokens fit ctx_len {ctx_len}")

    base_k = compiled[0]
    if base_k != 0:
        notes.append(f"target-only runs on the smallest compiled K ({base_k}, a {base_k + 1}-token "
                     "window) because K=0 is not compiled: the baseline is slower than it could be")
    ours, gated = _our_cases(gens, methods, policies, draft_p_min, ks, base_k, batch,
                             max_new_tokens, temperature)

    peer_objs = _make_peers(peers, manifest, peer_ks, max_new_tokens, set(gen.eos_ids),
                            cache_dir, say)
    cases = ours + [c for p in peer_objs for c in p.cases]
    warmup = prompt_ids[:batch]
    probe = make_probe(gen)
    turns = MemoryTurns([base.target, base.draft], peer_objs, say)
    _run_interleaved(cases, ours[0][0], gens, gated, warmup, prompt_ids, repeats, probe, say,
                     turns)
    if turns.turns:
        notes.append(f"our sessions were released {turns.turns} time(s) between passes to make "
                     "room for a peer that loads its own copy of the models, and loaded again "
                     "before our next configuration (never inside a timed pass)")
    base_decode = decode_figures(ours[0][0])
    bandwidth = target_only_bandwidth(gen, ours[0][0].engine, [len(p) for p in prompt_ids],
                                      base_decode and base_decode["tokens_per_s"], probe)
    del probe
    report = build_report(bundle, manifest, prompt_label, prompt_ids, prompts, max_new_tokens,
                          repeats, ks, methods, ours, peer_objs, notes, gen, machine, bandwidth,
                          sampled=temperature > 0, cpu_start=cpu_start)
    report["settings"].update({"spec_policies": list(policies), "draft_p_min": draft_p_min,
                               "temperature": temperature})
    if "suffix" in methods:  # the C tree or the Python one: the same proposals, not the same cost
        report["settings"]["suffix_tree"] = suffix_tree.IMPLEMENTATION
    return report


def _make_peers(peers: tuple[str, ...], manifest: dict, peer_ks: list[int], max_new_tokens: int,
                eos_ids: set[int], cache_dir: Path | None, say: Say) -> list:
    """Each requested peer with its cases (or the reason it is skipped)."""
    peer_objs: list = []
    for name in peers:
        make = find_peer(name)
        peer_objs.append(make(manifest, peer_ks, max_new_tokens, eos_ids, cache_dir, say))
        p = peer_objs[-1]
        say(f"peer {p.name}: {p.status}" + (f" ({p.note})" if p.note else ""))
    return peer_objs


def _encode_prompts(gen, prompts: list[str], chat: bool, room: int
                    ) -> tuple[list[list[int]], int]:
    """Each prompt's token ids (as a chat turn when `chat`), cut to its last `room` tokens;
    and how many were cut."""
    prompt_ids, truncated = [], 0
    for p in prompts:
        ids = gen.chat_prompt(p) if chat else gen.encode(p)
        if not ids:
            raise UsageError(f"prompt '{p[:30]}' encodes to no tokens")
        if len(ids) > room:  # keep the end of the prompt: the continuation depends on it
            ids, truncated = ids[-room:], truncated + 1
        prompt_ids.append(ids)
    return prompt_ids, truncated


def _our_cases(gens: dict, methods: list[str], policies, draft_p_min: float | None,
               ks: list[int], base_k: int, batch: int, max_new_tokens: int, temperature: float
               ) -> tuple[list[tuple[Measure, Callable]], dict]:
    """Our configurations: target-only first (the baseline), then each method, policy and K;
    and the gated rows' generators (`_gated_generators`)."""
    gen = gens[methods[0]]
    ours: list[tuple[Measure, Callable]] = [
        (Measure("qpcbuild", "target_only", base_k, "target-only"),
         _our_runner(gen.sibling(target_only=True), "target_only", None, batch, max_new_tokens,
                     temperature=temperature))]
    gated = _gated_generators(gens, policies, draft_p_min)
    for m in methods:
        for policy in policies:
            for k in ks:
                g, label = (gens[m], f"{m} K={k}") if policy == "fixed" else gated[(m, policy)]
                if policy != "fixed":
                    label = label.format(k=k)
                ours.append((Measure("qpcbuild", m, k, label),
                             _our_runner(g, m, k, batch, max_new_tokens, policy, temperature)))
    return ours, gated


def _pass_order(cases: list, rep: int) -> list:
    """Measured repeats alternate forward and reverse order (A B C, C B A, ...): whichever
    configuration ran first in every pass would alone carry what running first costs (the
    previous pass's state, drift within a pass); over pairs of repeats each place in the order
    falls on every configuration. Repeat 0, the warm-up, runs forward."""
    return cases[::-1] if rep and rep % 2 == 0 else cases


def _run_interleaved(cases: list[tuple[Measure, Callable]], baseline: Measure, gens: dict,
                     gated: dict, warmup: list[list[int]], prompt_ids: list[list[int]],
                     repeats: int, probe, say: Say, turns: MemoryTurns | None = None) -> None:
    """The timed passes, filling each case's Measure. Repeats interleaved: every repeat runs
    every configuration over the whole prompt set in turn (so each runs warm, as it would in
    use), forward and reverse by turns, and drift spreads over all configurations. Repeat 0 is a
    warm-up on the first prompt batch and is not counted."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()  # what is loaded now (models, libraries) stays out of the collections below
    warm_tps: dict[str, float] = {}  # each peer's target-only tokens/s in the warm-up
    baseline_run: dict[str, Callable] = {}
    peer_of = {p.name: p for p in (turns.peers if turns else [])}
    for rep in range(repeats + 1):
        warm = rep == 0
        for meas, run in _pass_order(cases, rep):
            if meas.error or meas.skipped:
                continue
            if turns is not None:  # our bundle and a memory-heavy peer take turns in memory
                if meas.system == "qpcbuild":
                    turns.before_ours()
                elif meas.system in peer_of:
                    turns.before_peer(peer_of[meas.system])
            if meas.system == "qpcbuild" and meas.method in ("ngram", "suffix"):
                # Its own proposer, fresh each repeat: suffix decoding's cross-request cache
                # holds only the earlier prompts of this pass, never this very continuation.
                for g in [gens[meas.method]] + [g for (m, _), (g, _) in gated.items()
                                                if m == meas.method]:
                    g.fresh_proposer()
            # As timeit does: no cyclic garbage collection inside a timed pass (its pauses would
            # land on whichever configuration happens to run); it runs between passes.
            gc.collect()
            gc.disable()
            try:
                # (our runner adds the engine's records to the Measure; a peer's adds its
                # own counters to a dict)
                sink = meas if meas.system == "qpcbuild" else meas.stats
                outs, tokens, seconds = run(warmup if warm else prompt_ids,
                                            None if warm else sink)
            except Exception as exc:
                if meas.system == "qpcbuild":
                    raise
                meas.error = f"{type(exc).__name__}: {exc}"
                say(f"  {meas.system} {meas.label} failed: {meas.error}")
                continue
            finally:
                gc.enable()
            rate = tokens / seconds if seconds > 0 else 0.0
            say(f"{'warm-up' if warm else f'repeat {rep}/{repeats}'} {meas.system} {meas.label}: "
                f"{rate:,.0f} tokens/s  (elapsed {time.perf_counter() - started:.0f} s)")
            if not warm:
                meas.seconds.append(seconds)
                meas.tokens.append(tokens)
                meas.outputs.append(outs)
                if meas is baseline and probe is not None:
                    probe.measure()
                continue
            if meas.system == "qpcbuild":
                continue
            if meas.method == "target_only":
                warm_tps[meas.system] = rate
                baseline_run[meas.system] = run
            elif rate < SLOW_PEER_FRACTION * warm_tps.get(meas.system, 0.0):
                # Far slower than the peer's own target-only, it cannot be the peer's best
                # configuration (the one worth comparing) and would dominate the run. A busy
                # machine slows whole stretches of time, so the check is repeated against the
                # peer's target-only measured right before it, on the same prompt: only a
                # configuration that is slow by itself is left out.
                _, tb, sb = baseline_run[meas.system](warmup, None)
                _, t2, s2 = run(warmup, None)
                ref = tb / sb if sb > 0 else 0.0
                rate2 = t2 / s2 if s2 > 0 else 0.0
                if rate2 < SLOW_PEER_FRACTION * ref:
                    meas.skipped = (f"not measured: {rate2:,.1f} tokens/s in its warm-up "
                                    f"against {ref:,.1f} for this peer's target-only just "
                                    f"before (under {SLOW_PEER_FRACTION:.0%}; first warm-up "
                                    f"{rate:,.1f} against {warm_tps[meas.system]:,.1f})")
                    say(f"  {meas.system} {meas.label}: {meas.skipped}")
    gc.unfreeze()


def _gated_generators(gens: dict, policies, draft_p_min: float | None) -> dict:
    """(method, policy) -> (a sibling generator for it, its row label with {k}): its own
    decoder, so the gate's estimates are its own; draft_p_min applies to these rows."""
    out = {}
    for m, g in gens.items():
        for policy in policies:
            if policy == "fixed":
                continue
            sib = g.sibling(m)
            label = f"{m} K={{k}} {policy}"
            if draft_p_min is not None and m in CONFIDENT_METHODS:
                sib.decoder.confidence_stop = ConfidenceStop(draft_p_min)
                label += f" p_min={draft_p_min:g}"
            out[(m, policy)] = (sib, label)
    return out


def bench(target: Path, *, overrides: list[str] = (), prompt_file: Path | None = None,
          prompt_set: str | None = None, num_prompts: int | None = None,
          ks: list[int] | None = None, methods: list[str] | None = None,
          max_new_tokens: int = 128, repeats: int = 3,
          peers: tuple[str, ...] = DEFAULT_PEERS,
          peer_ks: list[int] | None = None, cache_dir: Path | None = None,
          bundle_out: Path | None = None, json_out: Path | None = None,
          plot: Path | None | bool = None, say: Say | None = None,
          policies: tuple[str, ...] = ("fixed",), draft_p_min: float | None = None,
          temperature: float = 0.0, chat: bool = False,
          verify: str = "full") -> tuple[dict[str, Any], Path, Path | None]:
    """Bundle or recipe -> (report, JSON path, PNG path or None)."""
    say = say or (lambda m: None)
    target = Path(target)
    check_output_file(json_out, "--json-out")
    check_output_file(plot if isinstance(plot, Path) else None, "--plot")
    if is_bundle(target):
        if overrides:
            raise UsageError("--set applies to a recipe; this is a built bundle")
        bundle = target
    elif target.is_file():
        want = sorted(set([0] + list(ks or _recipe_ks(target, overrides))))
        out = Path(bundle_out) if bundle_out else default_bench_dir(target, list(overrides))
        bundle = build_for_measurement(target, list(overrides), want, out, cache_dir, say)
    else:
        raise UsageError(f"{target}: neither a bundle folder (with manifest.json) nor a recipe "
                         "file")
    label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    report = run_bench(bundle, prompts, prompt_label=label, ks=ks, methods=methods,
                       max_new_tokens=max_new_tokens, repeats=repeats, peers=peers,
                       peer_ks=peer_ks, cache_dir=cache_dir, say=say,
                       model_paths=_local_models(target, overrides, bundle),
                       policies=policies, draft_p_min=draft_p_min, temperature=temperature,
                       chat=chat, verify=verify)
    from .plot import plot_report
    from .report import default_json_path, write_outputs

    json_path, png = write_outputs(report, json_out or default_json_path(bundle, report["name"]),
                                   plot, plot_report)
    return report, json_path, png


def _recipe_ks(recipe: Path, overrides) -> tuple[int, ...]:
    """The Ks a bench bundle built from `recipe` compiles: 0..8, or for turbo heads 0 up to the
    head count (a K has one head per proposed token; there is none past the last)."""
    from ..plan import make_plan
    from ..recipe import load_recipe

    turbo = make_plan(load_recipe(recipe, list(overrides))).role("target").turbo
    return BENCH_KS if turbo is None else tuple(range(turbo.info.num_heads + 1))


def _local_models(target: Path, overrides, bundle: Path) -> dict[str, Path]:
    """Each role's checkpoint folder, for the peers: from the recipe when bench was given one,
    else the bundle's recorded reference when it names a folder from here."""
    from ..bundle import read_manifest
    from ..recipe import load_recipe, resolve_model_path

    if not is_bundle(target):
        r = load_recipe(target, list(overrides))
        refs = {"target": r.target.model, "draft": r.draft.model}
        found = {role: Path(resolve_model_path(r, ref)) for role, ref in refs.items() if ref}
    else:
        found = {role: Path(info.source.ref).expanduser().resolve()
                 for role, info in read_manifest(bundle).roles.items()}
    return {role: p for role, p in found.items() if (p / "config.json").is_file()}
