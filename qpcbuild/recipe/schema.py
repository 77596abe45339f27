"""The recipe's schema: the typed model of the one YAML file a user writes, with the cards it
knows. A module of its own below the package's __init__.py (which loads, validates and resolves
a recipe and re-exports these names), so each stays under the size the project reads
comfortably."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..errors import Problem

MAX_K = 32
MAX_CTX_LEN = 1 << 20  # beyond any released model's context; a model's own limit is checked too
CTX_LEN_MULTIPLE = 32

# Cards we know: QIDs (SoCs) per card, NSP cores per QID, on-board DRAM per QID in GiB.
# Source: Qualcomm Cloud AI 100 product briefs (Ultra: 4 SoCs, 64 cores, 128 GB;
# Pro: 1 SoC, 16 cores, 32 GB; Standard: 1 SoC, 14 cores, 16 GB).
CARDS: dict[str, dict[str, int]] = {
    "cloud-ai-100-ultra": {"qids": 4, "cores_per_qid": 16, "dram_gib_per_qid": 32},
    "cloud-ai-100-pro": {"qids": 1, "cores_per_qid": 16, "dram_gib_per_qid": 32},
    "cloud-ai-100-standard": {"qids": 1, "cores_per_qid": 14, "dram_gib_per_qid": 16},
}

# Published per-card figures for `tune --cost-model`, divided per QID (SoC): DDR bandwidth and
# fp16 compute. Source: the Cloud AI SDK documentation, "Architecture", table of SKUs
# (https://quic.github.io/cloud-ai-sdk-pages/latest/Getting-Started/Architecture): DDR BW
# Standard 137 GB/s, Pro 137 GB/s, Ultra 548 GB/s (4 SoCs); FP16 110 / 125 / 290 TFLOPs. These
# are AI 100 figures; an ai200 card has none here (give --card-bandwidth-gbs and --card-tflops).
CARD_ROOFLINE_SOURCE = ("Qualcomm Cloud AI SDK documentation, Getting-Started/Architecture, "
                        "table of SKUs")
CARD_ROOFLINE: dict[str, dict[str, float]] = {
    "cloud-ai-100-ultra": {"dram_gbs_per_qid": 548 / 4, "fp16_tflops_per_qid": 290 / 4},
    "cloud-ai-100-pro": {"dram_gbs_per_qid": 137.0, "fp16_tflops_per_qid": 125.0},
    "cloud-ai-100-standard": {"dram_gbs_per_qid": 137.0, "fp16_tflops_per_qid": 110.0},
}

Method = Literal["draft_model", "ngram", "suffix", "turbo", "eagle3"]
METHODS: tuple[str, ...] = get_args(Method)  # the one list of speculation methods
# The methods whose proposals come from a distribution that speculation.draft_p_min can read
CONFIDENT_METHODS: tuple[str, ...] = ("draft_model", "eagle3")
Backend = Literal["onnxruntime", "qaic"]
# The names of the backends that run on an accelerator card (backend_api.BACKENDS' runs_on_host
# False; tests/test_backend_names.py holds the two together)
CARD_BACKENDS: tuple[str, ...] = ("qaic",)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRef(_Strict):
    model: str = Field(min_length=1)
    revision: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False  # .bin/.pt checkpoints execute code on load: opt in only
    allow_unused_weights: bool = False  # tensors config.json does not describe: opt in only


class Draft(_Strict):
    method: Method = "draft_model"
    # draft_model: the draft's checkpoint; turbo: the head folder (speculator_config.json +
    # speculator.safetensors, QEfficient's format: models/turbo_heads.py); eagle3: the head folder
    # (config.json + model.safetensors, the speculators format: models/eagle3_head.py)
    model: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    allow_unused_weights: bool = False
    # A JSON file {"token_ids": [...]} (relative to the recipe): the draft's LM head keeps only
    # these rows, so a call reads less; it proposes only these tokens, never changing the output.
    vocab_subset: str | None = Field(default=None, min_length=1)
    # ngram (vLLM names and defaults)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    # suffix (vLLM names and defaults)
    suffix_decoding_max_tree_depth: int | None = Field(default=None, ge=1)
    suffix_decoding_max_cached_requests: int | None = Field(default=None, ge=0)
    suffix_decoding_max_spec_factor: float | None = Field(default=None, gt=0)
    suffix_decoding_min_token_prob: float | None = Field(default=None, ge=0, le=1)


# vLLM's: both 5 when neither is given, one given -> the other takes its value (method_options)
NGRAM_DEFAULTS: dict[str, Any] = {"prompt_lookup_min": 5, "prompt_lookup_max": 5}
SUFFIX_DEFAULTS: dict[str, Any] = {
    "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


VLLM_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min/max when neither is given


def vllm_lookup_range(lo: int | None, hi: int | None) -> tuple[int, int]:
    """vLLM's resolution of prompt_lookup_min/max: neither given -> 5 and 5; one given -> the
    other takes its value."""
    if lo is None and hi is None:
        return VLLM_NGRAM_DEFAULT, VLLM_NGRAM_DEFAULT
    if lo is None or hi is None:
        given = lo if hi is None else hi
        assert given is not None  # (one of the two is given)
        return given, given
    return lo, hi


class Speculation(_Strict):
    num_speculative_tokens: Union[int, list[int]] = 3
    # auto: speculate only while it is faster than decoding without (docs/adaptive.md; the
    # plan compiles K=0 for it); fixed: always; off: never
    policy: Literal["auto", "fixed", "off"] = "fixed"
    # draft_model: a row stops proposing when the draft's top probability is below this
    # (llama.cpp's --draft-p-min); 0 = never
    draft_p_min: float = Field(default=0.0, ge=0, le=1)
    # K per number of live rows, {batch size: K} (`tune --per-batch`); compiled with the Ks
    num_speculative_tokens_per_batch_size: dict[int, int] | None = None


class Shapes(_Strict):
    batch_size: int = Field(default=1, ge=1, le=1024)
    full_batch_size: int | None = Field(default=None, ge=1, le=1024)
    prefill_seq_len: int = Field(default=32, ge=1, le=MAX_CTX_LEN)
    ctx_len: int = Field(default=128, ge=1, le=MAX_CTX_LEN)
    # Narrower prefill windows compiled next to prefill_seq_len: a prompt's last chunk goes
    # through the narrowest that holds it (a 70-token prompt is not computed as 128)
    prefill_tail_seq_lens: list[int] = []


class Precision(_Strict):
    quantization: Literal["none", "mxfp6"] = "none"
    kv_cache_dtype: Literal["float16", "mxint8"] = "float16"
    export_dtype: Literal["float32", "float16"] = "float32"


class RoleHardware(_Strict):
    device_group: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_cores: int | None = Field(default=None, ge=1)


class CompilerOptions(_Strict):
    aic_enable_depth_first: bool = False
    mos: int | None = Field(default=None, ge=1)
    allow_mxint8_mdp_io: bool = False
    extra_flags: list[str] = Field(default_factory=list)


class Hardware(_Strict):
    card: Literal["cloud-ai-100-ultra", "cloud-ai-100-pro", "cloud-ai-100-standard"] = \
        "cloud-ai-100-ultra"
    num_cards: int = Field(default=1, ge=1, le=16)
    aic_hw_version: Literal["ai100", "ai200"] = "ai100"
    target: RoleHardware = Field(default_factory=RoleHardware)
    draft: RoleHardware = Field(default_factory=RoleHardware)
    compiler_options: CompilerOptions = Field(default_factory=CompilerOptions)
    specializations_format: Literal["named", "flat"] = "named"


class NodeHardware(RoleHardware):
    """The prefill node of a disaggregated deployment: its devices, cores per QID and slots."""
    max_num_seqs: int | None = Field(default=None, ge=1)  # KV slots (None: the shapes' batch)


class DecodeNode(_Strict):
    """The decode node: the target and the draft on its cores (split as `hardware`'s), its
    slots."""
    target: RoleHardware = Field(default_factory=RoleHardware)
    draft: RoleHardware = Field(default_factory=RoleHardware)
    max_num_seqs: int | None = Field(default=None, ge=1)


class Disaggregated(_Strict):
    """Prefill on one node, decode (and all speculation) on another; the prompt's KV cache
    crosses from the first to the second (docs/disaggregated.md)."""
    # the two nodes' device groups may overlap only when they are on different hosts
    distinct_hosts: bool = False
    prefill: NodeHardware = Field(default_factory=NodeHardware)
    decode: DecodeNode = Field(default_factory=DecodeNode)


WeightFormat = Literal["float32", "int8", "int4"]
BlockSize = Literal[32, 64, 128]


class OrtOptions(_Strict):
    graph: Literal["fused", "portable"] = "fused"  # fused: ORT's GQA kernels; portable: as exported
    intra_op_threads: int | None = Field(default=None, ge=1)  # None: from the core split
    # Each role's matmul weights on ONNX Runtime: float32, or 8-/4-bit blocks of 32 along K
    # (com.microsoft.MatMulNBits, int8 activations). A draft's numerics change only which tokens
    # it proposes, never the output, so a smaller draft trades acceptance for speed; a quantized
    # *target* changes the output itself: opt-in, labelled in run/bench/manifest output, and
    # measured against the float32 target by `bench --numerics`. draft_weights also sets an
    # EAGLE-3 head's projections (method eagle3): the head proposes, so the same holds for it.
    draft_weights: WeightFormat = "float32"
    target_weights: WeightFormat = "float32"
    # The int8/int4 blocks' length along K: longer blocks store fewer scales and run the
    # integer kernel faster, at some agreement with the float32 weights (docs/weight-formats.md
    # measures both). None: blocks of 32.
    draft_block_size: BlockSize | None = None
    target_block_size: BlockSize | None = None


class Recipe(_Strict):
    schema_: Literal[1] = Field(alias="schema")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    target: ModelRef
    draft: Draft = Field(default_factory=Draft)
    speculation: Speculation = Field(default_factory=Speculation)
    shapes: Shapes = Field(default_factory=Shapes)
    precision: Precision = Field(default_factory=Precision)
    hardware: Hardware = Field(default_factory=Hardware)
    backends: list[Backend] = Field(default_factory=lambda: list[Backend](["onnxruntime"]),
                                    min_length=1)
    onnxruntime: OrtOptions = Field(default_factory=OrtOptions)
    disaggregated: Disaggregated | None = None  # None: one node runs both stages
    output: str | None = None

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    _source_dir: Path | None = PrivateAttr(default=None)
    _source: str = PrivateAttr(default="<recipe>")  # the file, for messages
    _warnings: list[Problem] = PrivateAttr(default_factory=list)
    _lines: dict[tuple[str | int, ...], int] = PrivateAttr(default_factory=dict)  # key path -> line

    # ----- resolved views (one place decides each default) -----
    @property
    def ks(self) -> tuple[int, ...]:
        """Compiled speculative lengths, ascending. ngram/suffix get [0, K] unless a list is given."""
        k = self.speculation.num_speculative_tokens
        if isinstance(k, list):
            return tuple(sorted(set(k)))
        if self.draft.method != "draft_model" and k > 0:
            return (0, k)
        return (k,)

    @property
    def compiled_ks(self) -> tuple[int, ...]:
        """What the target is compiled for: `ks`, plus K=0 for policy auto and the Ks of the
        per-batch-size schedule."""
        sp = self.speculation
        extra = {0} if sp.policy == "auto" else set()
        extra |= set((sp.num_speculative_tokens_per_batch_size or {}).values())
        return tuple(sorted(set(self.ks) | extra))

    @property
    def method_options(self) -> dict[str, Any]:
        if self.draft.method == "ngram":
            lo, hi = vllm_lookup_range(self.draft.prompt_lookup_min, self.draft.prompt_lookup_max)
            return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}
        defaults = {"suffix": SUFFIX_DEFAULTS}.get(self.draft.method, {})
        return {key: getattr(self.draft, key) if getattr(self.draft, key) is not None else value
                for key, value in defaults.items()}

    @property
    def source(self) -> str:
        return self._source

    def source_dir(self) -> Path:
        return self._source_dir or Path.cwd()

    @property
    def warnings(self) -> list[Problem]:
        return list(self._warnings)

    def line_of(self, path: str) -> int | None:
        loc = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]\.?", path) if p)
        return next((self._lines[loc[:i]] for i in range(len(loc), -1, -1)
                     if loc[:i] in self._lines), None)

    def output_dir(self) -> Path:
        out = Path(self.output or f"build/{self.name}")
        return out if out.is_absolute() else Path.cwd() / out

    def to_yaml_dict(self) -> dict[str, Any]:
        # (without the block the dump is as before it existed: bundle ids stay)
        return self.model_dump(mode="json", by_alias=True,
                               exclude=None if self.disaggregated else {"disaggregated"})
