"""export_model: one checkpoint streamed into its ONNX graph (the package docstring says how)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..version import __version__
from ..errors import QpcbuildError, UsageError
from ..models.arch import ArchSpec, arch_from_config
from ..models.safetensors import WeightReader
from ..models.source import ModelSource, safetensors_files, tokenizer_files
from ..models.eagle3_head import Eagle3Head
from ..models.turbo_heads import TurboHeads
from ..models.vocab_subset import subset_digest
from ..progress import step
from . import DATA_FILE, GRAPH_FILE, OPSET
from .builder import GraphBuilder, save, weight_key
from .decoder import Decoder


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    role: str
    arch: ArchSpec
    weights_digest: str  # over every tensor's name and source bytes, independent of sharding
    metadata: dict[str, str]


def _check_tokenizer(path: Path, arch: ArchSpec) -> None:
    files = tokenizer_files(path)
    if not files:
        return
    tok = path / "tokenizer.json"
    if tok.is_file():
        try:
            data = json.loads(tok.read_text(encoding="utf-8"))
            vocab = data.get("model", {}).get("vocab", {})
            size = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))],
                       default=-1) + 1 if isinstance(vocab, dict) else len(vocab)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError,
                KeyError) as exc:
            raise UsageError(f"{tok}: unreadable tokenizer ({exc})") from None
        if size > arch.vocab_size:
            raise UsageError(f"{tok}: tokenizer has {size} tokens but config.json's vocab_size is "
                             f"{arch.vocab_size}: the tokenizer does not belong to this model")


def _open_checkpoint(source: ModelSource, allow_pickle: bool,
                     allow_unused: bool) -> tuple[Path, ArchSpec, WeightReader]:
    """The model folder, its architecture and a reader of its weights, once the config, the
    tokenizer and every tensor's name and shape are checked (UsageError naming the folder)."""
    model_dir = source.require_path()
    arch = arch_from_config(source.config, f"{model_dir}/config.json")
    _check_tokenizer(model_dir, arch)
    from ..models.checkpoint import checkpoint_problems  # it reads headers with our own reader

    problems = checkpoint_problems(model_dir, arch, allow_pickle, allow_unused)
    if problems:
        raise UsageError(f"{model_dir}: " + "; ".join(problems))
    reader = WeightReader(safetensors_files(model_dir, allow_pickle), allow_pickle)
    if not arch.tie_word_embeddings and not reader.has("lm_head.weight"):
        raise UsageError(f"{model_dir}: config says tie_word_embeddings=false but the checkpoint "
                         "has no lm_head.weight")
    return model_dir, arch, reader


def _check_role(role: str, vocab_subset: np.ndarray | None, turbo: TurboHeads | None,
                eagle3: Eagle3Head | None) -> None:
    """What each role's graph may carry (the plan never asks for anything else)."""
    if role not in ("target", "draft"):
        raise UsageError(f"role must be 'target' or 'draft', not '{role}'")
    if vocab_subset is not None and role != "draft":
        raise UsageError("a vocabulary subset is for drafts only: the target's logits decide "
                         "the output")
    if turbo is not None and role != "target":
        raise UsageError("turbo heads ride in the target's graph, not a draft's")
    if eagle3 is not None and role != "target":
        raise UsageError("an EAGLE-3 head reads the target's features, not a draft's")


def _heads_metadata(turbo: TurboHeads | None, eagle3: Eagle3Head | None) -> dict[str, str]:
    """The graph's record of the draft heads it carries (what the ONNX Runtime lowering reads
    back); nothing for a graph without them, so its bytes stay as before."""
    out = {}
    if turbo:
        out.update(turbo_heads=turbo.info.sha256, turbo_num_heads=str(turbo.info.num_heads),
                   turbo_num_layers=str(turbo.info.num_layers))
    if eagle3:
        out.update(eagle3_head=eagle3.info.sha256,
                   eagle3_layers=",".join(map(str, eagle3.info.aux_layer_ids)))
    return out


def export_model(source: ModelSource, role: str, out_dir: Path, *, continuous_batching: bool = False,
                 weight_dtype: str = "float32", allow_pickle: bool = False,
                 allow_unused: bool = False,
                 vocab_subset: np.ndarray | None = None,
                 turbo: TurboHeads | None = None,
                 eagle3: Eagle3Head | None = None) -> ExportResult:
    """Write `out_dir/model.onnx` + `model.onnx.data` for `role` ("target" | "draft").
    `vocab_subset` (draft only; sorted unique token ids): the LM head keeps only those rows.
    `turbo` (target only): draft heads compiled into the logits (export/turbo.py).
    `eagle3` (target only): the head's feature output beside the logits (export/eagle3.py)."""
    _check_role(role, vocab_subset, turbo, eagle3)
    model_dir, arch, reader = _open_checkpoint(source, allow_pickle, allow_unused)

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        with open(tmp / DATA_FILE, "wb") as data, \
                step(f"exporting {role} {source.ref}", len(reader.tensors) + len(reader.pickled),
                     "tensors") as advance:
            g = GraphBuilder(data, DATA_FILE)
            loaded: dict[str, str] = {}
            written: set[str] = set()
            np_dtype = np.float16 if weight_dtype == "float16" else np.float32

            def load(name: str, shape: tuple[int, ...], transpose: bool,
                     rows: np.ndarray | None = None, offset: float = 0.0) -> str:
                key = weight_key(name, transpose, rows is not None, offset)
                if key not in loaded:
                    stored = reader.stored(name, shape)
                    if stored.non_finite():
                        raise UsageError(f"{model_dir}: tensor '{name}' holds NaN or infinite "
                                         "values; the checkpoint is damaged")
                    values = stored.values if rows is None else stored.values[rows]
                    widen = stored.widen
                    if offset:  # in float32, as transformers computes (1.0 + w.float())
                        values = (widen(values) if widen else values).astype(np.float32) + \
                            np.float32(offset)
                        widen = None
                    w = g.weight(key, values.T if transpose else values, stored.sha256, np_dtype,
                                 widen=widen)
                    del stored, values  # the mapping is released tensor by tensor
                    if name not in written:  # not again for its transposed or subset form
                        written.add(name)
                        advance(1)
                    loaded[key] = w if np_dtype == np.float32 else \
                        g.op("Cast", w, to=onnx.TensorProto.FLOAT)
                return loaded[key]

            Decoder(g, arch, load, vocab_subset, turbo=turbo,
                    eagle3=eagle3).build(role, continuous_batching)
            data.flush()
            os.fsync(data.fileno())
        # one entry per source tensor, however many forms of it the graph holds
        per_tensor = sorted(f"{k.split('^')[0]}:{v}" for k, v in g.weight_hashes.items())
        weights_digest = hashlib.sha256("\n".join(sorted(set(per_tensor))).encode()).hexdigest()
        # Content only: where the model came from is the manifest's business, and a path here
        # would make the artifact (and every bundle id) depend on the checkout's location.
        metadata = {"qpcbuild_version": __version__, "role": role, "weights_digest": weights_digest,
                    "config_digest": source.config_digest, "architecture": arch.architecture,
                    "continuous_batching": str(continuous_batching).lower(),
                    "weight_dtype": weight_dtype,
                    **({"vocab_subset": subset_digest(vocab_subset)}
                       if vocab_subset is not None else {}),
                    **_heads_metadata(turbo, eagle3)}
        save(g.model(f"qpcbuild_{role}", OPSET, metadata), tmp / GRAPH_FILE)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise QpcbuildError(f"writing {out_dir} failed: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out_dir / GRAPH_FILE, role, arch, weights_digest, metadata)
