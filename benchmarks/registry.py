"""The registry's three goals, measured side by side on one machine (docs/registry.md):

1. a second runner with an empty local cache builds a recipe from the remote cache much faster
   than a cold build, with the same bundle id (cold, seed and warm builds interleaved per round);
2. push and pull of the bundle run at a good fraction of a plain file copy's speed on the same
   disk (cp -r, push, pull interleaved per round, each push to an empty registry, each timed
   until what it wrote is fsynced); beside them the registry's own ingest: the same files
   sent by a client that does nothing else (one monolithic PUT each, digests given), which
   no push can beat;
3. two bundles that differ only in the draft store the target's graph once (registry storage).

Usage: python benchmarks/registry.py [--recipe recipes/smollm2.yaml] [--rounds 2] [--work DIR]
Needs Debian's docker-registry (apt-get install docker-registry), started here on a loopback port.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qpcbuild.bundle import read_manifest  # noqa: E402  (after its sys.path entry)
from qpcbuild.registry.bundles import pull_bundle, push_bundle  # noqa: E402  (after its sys.path entry)
from qpcbuild.registry.client import RegistryClient  # noqa: E402  (after its sys.path entry)
from qpcbuild.registry.reference import parse_reference  # noqa: E402  (after its sys.path entry)
from qpcbuild.testing import RegistryServer, free_port  # noqa: E402  (after its sys.path entry)
from qpcbuild.tree import file_digest  # noqa: E402  (after its sys.path entry)

QPCBUILD = [sys.executable, "-m", "qpcbuild"]


def compile_(recipe: Path, out: Path | None, cache: Path, *extra: str) -> tuple[dict, float]:
    """(compile --json result, wall seconds of the whole process). `out` None: the build
    pushes (--push in `extra`), staging under the cache's folder."""
    t0 = time.perf_counter()
    done = subprocess.run([*QPCBUILD, "compile", str(recipe), *(["-o", str(out)] if out else []),
                           "--cache-dir", str(cache), "--json", *extra], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                          cwd=cache.parent)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"compile failed: {done.stderr}")
    return json.loads(done.stdout), wall


def builds(recipe: Path, work: Path, server: RegistryServer, rounds: int) -> list[dict]:
    rows = []
    for r in range(rounds):
        remote = f"{server.address}/bench/round{r}"
        cold, cold_wall = compile_(recipe, work / f"cold{r}", work / f"cache-cold{r}")
        seed, seed_wall = compile_(recipe, work / f"seed{r}", work / f"cache-seed{r}",
                                   "--remote-cache", remote)
        warm, warm_wall = compile_(recipe, work / f"warm{r}", work / f"cache-warm{r}",
                                   "--remote-cache", remote)
        # The same pair as CI ships it: built and pushed (`compile --push`), cold, and on a
        # runner whose cache is the registry (artifacts mounted, not downloaded).
        cold_push, cold_push_wall = compile_(recipe, None, work / f"cache-cpush{r}", "--push",
                                             f"{server.address}/bench/cold{r}:v1")
        warm_push, warm_push_wall = compile_(recipe, None, work / f"cache-wpush{r}", "--push",
                                             f"{server.address}/bench/warm{r}:v1",
                                             "--remote-cache", remote)
        assert {s["from"] for s in warm["stages"] + warm_push["stages"]} == {"remote"}
        assert len({b["bundle_id"] for b in (cold, seed, warm, cold_push, warm_push)}) == 1
        rows.append({"round": r, "cold_build_s": cold["seconds"], "cold_wall_s": cold_wall,
                     "seed_build_and_push_s": seed["seconds"], "seed_wall_s": seed_wall,
                     "warm_build_s": warm["seconds"], "warm_wall_s": warm_wall,
                     "speedup_build": cold["seconds"] / warm["seconds"],
                     "speedup_wall": cold_wall / warm_wall, "bundle_id": warm["bundle_id"],
                     "cold_push_s": cold_push["seconds"], "cold_push_wall_s": cold_push_wall,
                     "cold_push_uploaded": cold_push["pushed"]["transferred_bytes"],
                     "warm_push_s": warm_push["seconds"], "warm_push_wall_s": warm_push_wall,
                     "warm_push_uploaded": warm_push["pushed"]["transferred_bytes"],
                     "speedup_push": cold_push["seconds"] / warm_push["seconds"],
                     "speedup_push_wall": cold_push_wall / warm_push_wall,
                     "speedup_folder_to_push": cold["seconds"] / warm_push["seconds"]})
        print(json.dumps(rows[-1]), flush=True)
        for name in (f"cache-cold{r}", f"cache-seed{r}", f"cache-warm{r}", f"seed{r}",
                     f"warm{r}", f"cache-cpush{r}", f"cache-wpush{r}"):
            shutil.rmtree(work / name)
    return rows


def flush(folder: Path) -> None:
    """fsync every file under `folder`: what the step just wrote reaches the disk. (Not
    `sync`: on a shared machine that also waits for every other process's writes.)"""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def transfers(bundle: Path, work: Path, rounds: int) -> list[dict]:
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    rows = []
    for r in range(rounds):
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(bundle), str(work / "copy")], check=True)
        flush(work / "copy")
        cp_s = time.perf_counter() - t0
        shutil.rmtree(work / "copy")
        server = RegistryServer(work / f"xfer-registry{r}")
        server.port = free_port()
        server.start()
        try:
            ref = parse_reference(f"{server.address}/bench/bundle:v1")
            with RegistryClient(ref.registry) as client:
                t0 = time.perf_counter()
                pushed, _ = push_bundle(bundle, ref, client)
                flush(server.storage)
                push_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                pull_bundle(ref, work / "pulled", client)
                flush(work / "pulled")
                pull_s = time.perf_counter() - t0
            assert pushed.sent == size, (pushed.sent, size)
        finally:
            server.stop()
            shutil.rmtree(work / f"xfer-registry{r}", ignore_errors=True)
        shutil.rmtree(work / "pulled")
        ingest_s = registry_ingest(bundle, work / f"ingest-registry{r}")
        mb = size / 1e6
        rows.append({"round": r, "bytes": size, "cp_MBps": mb / cp_s, "push_MBps": mb / push_s,
                     "pull_MBps": mb / pull_s, "ingest_MBps": mb / ingest_s,
                     "push_vs_cp": cp_s / push_s, "pull_vs_cp": cp_s / pull_s,
                     "ingest_vs_cp": cp_s / ingest_s, "push_vs_ingest": ingest_s / push_s})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def registry_ingest(bundle: Path, storage: Path) -> float:
    """Seconds for an empty registry to take in the bundle's files from a client that only
    streams them: one upload session and one PUT per file, its digest computed before the
    clock starts, no verification, retries or anything else of ours; until fsynced."""
    files = [p for p in sorted(bundle.rglob("*")) if p.is_file()]
    digests = {p: "sha256:" + file_digest(p) for p in files}  # before the clock starts
    server = RegistryServer(storage)
    server.port = free_port()
    server.start()
    try:
        with httpx.Client(base_url=f"http://{server.address}", timeout=600) as http:
            t0 = time.perf_counter()
            for path in files:
                session = http.post("/v2/bench/ingest/blobs/uploads/")
                location = session.headers["Location"]
                with open(path, "rb") as f:
                    done = http.put(location + ("&" if "?" in location else "?")
                                    + f"digest={digests[path]}", content=iter(
                                        lambda: f.read(4 << 20), b""),
                                    headers={"Content-Type": "application/octet-stream",
                                             "Content-Length": str(path.stat().st_size)})
                assert done.status_code == 201, (path, done.status_code, done.text[:200])
            flush(server.storage)
            return time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(storage, ignore_errors=True)


def pull_memory(bundle: Path, work: Path) -> dict:
    """Peak RSS of a `qpcbuild pull` process (its largest file must not be held in memory)."""
    server = RegistryServer(work / "rss-registry")
    server.port = free_port()
    server.start()
    try:
        ref = parse_reference(f"{server.address}/bench/bundle:v1")
        with RegistryClient(ref.registry) as client:
            push_bundle(bundle, ref, client)
        proc = subprocess.Popen([*QPCBUILD, "pull", str(ref), "-d", str(work / "rss-pulled")],
                                env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0
    finally:
        server.stop()
        shutil.rmtree(work / "rss-registry", ignore_errors=True)
        shutil.rmtree(work / "rss-pulled", ignore_errors=True)
    largest = max(f.size for f in read_manifest(bundle).files.values())
    return {"pull_peak_rss_MB": usage.ru_maxrss / 1024, "largest_file_MB": largest / 1e6}


def dedup(recipe: Path, bundle: Path, work: Path, cache: Path) -> dict:
    """Push the bundle, then one differing only in its draft: what the second one adds."""
    other, _ = compile_(recipe, work / "other", cache, "--set", "draft.vocab_subset=null")
    server = RegistryServer(work / "dedup-registry")
    server.port = free_port()
    server.start()
    try:
        with RegistryClient(server.address) as client:
            push_bundle(bundle, parse_reference(f"{server.address}/bench/pair:a"), client)
            after_a = server.blob_bytes()
            push_bundle(work / "other", parse_reference(f"{server.address}/bench/pair:b"), client)
            after_b = server.blob_bytes()
    finally:
        server.stop()
        shutil.rmtree(work / "dedup-registry", ignore_errors=True)
    a, b = read_manifest(bundle).files, read_manifest(work / "other").files
    shared = sum(f.size for p, f in b.items() if p in a and a[p].sha256 == f.sha256)
    return {"bundle_a_bytes": sum(f.size for f in a.values()),
            "bundle_b_bytes": sum(f.size for f in b.values()),
            "shared_bytes": shared, "stored_after_a": after_a, "stored_after_b": after_b,
            "added_by_b": after_b - after_a,
            "target_graph_bytes": sum(f.size for p, f in b.items()
                                      if p.startswith("target/"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="qpcbuild-registry-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    server = RegistryServer(work / "registry")
    server.port = free_port()
    server.start()
    try:
        report = {"recipe": str(args.recipe), "builds": builds(args.recipe, work, server,
                                                               args.rounds)}
    finally:
        server.stop()
    bundle = work / "cold0"
    report["transfers"] = transfers(bundle, work, args.rounds)
    report["memory"] = pull_memory(bundle, work)
    print(json.dumps(report["memory"]), flush=True)
    report["dedup"] = dedup(args.recipe, bundle, work, work / "cache-dedup")
    print(json.dumps(report["dedup"]), flush=True)
    report["medians"] = {name: statistics.median(row[name] for row in report[part])
                         for part, names in (("builds", ("speedup_build", "speedup_wall",
                                                         "speedup_push", "speedup_push_wall",
                                                         "speedup_folder_to_push")),
                                             ("transfers", ("push_vs_cp", "pull_vs_cp",
                                                            "ingest_vs_cp", "push_vs_ingest")))
                         for name in names}
    print(json.dumps(report["medians"]), flush=True)
    out = REPO / "benchmarks" / "results" / "registry.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}; scratch in {work}")


if __name__ == "__main__":
    main()
