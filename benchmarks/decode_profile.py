"""Where one decode call's time goes, next to what weight streaming reaches here.

`qpcbuild bench` reports target-only decode as a fraction of a weight-streaming probe (ONNX
Runtime's MatMul over a float32 matrix as large as the target's weights). This script explains
that fraction: it opens a bundle's target session exactly as `qpcbuild run` does, times
`--calls` calls per window size (seq_len 1 = a decode, K+1 = a verify) with ONNX Runtime's
profiler on, sums kernel time per operator type, and measures the probe in the same run.

    python benchmarks/decode_profile.py build/smollm2-ngram-bench --seq-lens 1,5
    python benchmarks/decode_profile.py build/smollm2-ngram-bench --json-out profile.json
    python benchmarks/decode_profile.py build/smollm2 --role draft --seq-lens 1

The profiler adds a little time per node; the shares, and the MatMul kernels' own GB/s against
the probe, are what the figures are for. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POSITION = 300  # KV positions already valid when the timed calls start


def profile(bundle: Path, seq_lens: list[int], calls: int, role: str = "target") -> dict:
    import onnxruntime as ort

    from qpcbuild.bench.bandwidth import StreamingProbe, graph_bytes
    from qpcbuild.bundle import read_manifest
    from qpcbuild.bundle.manifest_model import Specialization
    from qpcbuild.runtime.loader import _open_session
    from qpcbuild.runtime.session import OrtSession

    # The loader's own session for the role (shapes, threads, KV binding as `run` has them),
    # with one specialization per profiled window instead of the compiled ones.
    manifest = read_manifest(bundle)
    if role not in manifest.roles:
        raise SystemExit(f"{bundle}: no {role} in this bundle")
    info = manifest.roles[role]
    symbols = info.specializations[0].symbols
    windows = [Specialization(name=f"w{s}", symbols={
        **symbols, "seq_len": str(s), **({"num_logits_to_keep": str(s)} if role == "target"
                                         else {})}) for s in seq_lens]
    manifest = manifest.model_copy(update={"roles": {
        **manifest.roles, role: info.model_copy(update={"specializations": windows})}})
    tmp = Path(tempfile.mkdtemp(prefix="qpcbuild-profile-"))
    plain = ort.SessionOptions

    def profiled():  # the session's own options, plus the profiler
        so = plain()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp / "decode")
        return so

    ort.SessionOptions = profiled
    try:
        sess = _open_session(bundle, manifest, role, "onnxruntime")
    finally:
        ort.SessionOptions = plain
    if not isinstance(sess, OrtSession):
        raise SystemExit(f"{bundle}: the {role} is not an ONNX Runtime session")
    warm = 5
    for s in seq_lens:
        ids = np.ones((sess.batch_size, s), np.int64)
        for c in range(warm + calls):
            start = POSITION + c * s
            sess.run(ids, np.tile(np.arange(start, start + s), (sess.batch_size, 1)))
    events = json.loads(Path(sess.sess.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    graph = graph_bytes(sess.path)
    probe = StreamingProbe(graph, sess.threads)
    probe_gbs = probe.measure()
    out = {"bundle": str(bundle), "role": role, "threads": sess.threads, "calls": calls,
           "weights_mb": round(graph["full_bytes"] / 1e6, 1),
           "probe": {"kernel": probe.kernel, "gbs": round(probe_gbs, 2)}, "windows": []}
    for i, s in enumerate(seq_lens):
        timed = runs[i * (warm + calls) + warm:(i + 1) * (warm + calls)]
        lo, hi = timed[0]["ts"], timed[-1]["ts"] + timed[-1]["dur"]
        per_op: dict[str, float] = collections.defaultdict(float)
        for e in nodes:
            if lo <= e["ts"] <= hi:
                per_op[e["args"]["op_name"]] += e["dur"] / calls / 1e3
        run_ms = statistics.fmean(r["dur"] for r in timed) / 1e3  # a mean, as the op sums
        kernels = sum(per_op.values())
        matmul = sum(v for k, v in per_op.items() if k.startswith("MatMul"))
        out["windows"].append({
            "seq_len": s, "call_ms": round(run_ms, 3), "kernels_ms": round(kernels, 3),
            "outside_kernels_ms": round(run_ms - kernels, 3),
            "matmul_gbs": round(graph["full_bytes"] / (matmul / 1e3) / 1e9, 2) if matmul else None,
            "ops_ms": {k: round(v, 3) for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])}})
    return out


def show(r: dict) -> None:
    print(f"{r['bundle']} {r['role']}: {r['threads']} threads, {r['weights_mb']:,} MB of weights; "
          f"weight streaming ({r['probe']['kernel']}): {r['probe']['gbs']} GB/s")
    for w in r["windows"]:
        print(f"\nseq_len {w['seq_len']}: {w['call_ms']} ms per call (mean, profiled), "
              f"{w['kernels_ms']} ms in kernels, {w['outside_kernels_ms']} ms outside them")
        if w["matmul_gbs"]:
            print(f"  MatMul kernels stream the weights at {w['matmul_gbs']} GB/s = "
                  f"{w['matmul_gbs'] / r['probe']['gbs']:.0%} of the probe")
        for op, ms in list(w["ops_ms"].items())[:8]:
            print(f"  {op:36s} {ms:8.3f} ms  {ms / w['call_ms']:5.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--seq-lens", default="1,5", help="window sizes to profile (1 = decode)")
    ap.add_argument("--role", choices=("target", "draft"), default="target")
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    r = profile(args.bundle, [int(x) for x in args.seq_lens.split(",")], args.calls, args.role)
    show(r)
    if args.json_out:
        args.json_out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
