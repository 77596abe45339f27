"""Train the demo target/draft pair that makes qpcbuild run offline.

Data: the Python sources of the running interpreter's standard library (test folders skipped),
split by a hash of each file's relative path so the 2% validation split never changes.
Models: two Llama-architecture decoders sharing one byte-level BPE tokenizer. The draft learns
from the data and, at the same time, from the target's own predictions (distillation), because
what speculative decoding rewards is agreement with the target, not perplexity alone.

Run:  python scripts/train_demo_pair.py            # ~25 minutes on 2 cores, writes models/demo/
      python scripts/train_demo_pair.py --steps 20 --out /tmp/demo   # a quick smoke run
Needs torch and transformers (the `dev` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from stdlib_corpus import stdlib_sources  # scripts/ is on sys.path when a script runs

EOS = "<|endoftext|>"
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Settings:
    seed: int = 1234
    vocab_size: int = 4096
    steps: int = 1200
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.1
    distill_weight: float = 0.7  # share of the draft's loss that is KL to the target
    validation_percent: int = 2
    eval_windows: int = 96
    eval_prompts: int = 20
    eval_prompt_tokens: int = 96
    eval_new_tokens: int = 64
    eval_k: int = 4


TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=688)
DRAFT_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=344)


# ---------------------------------------------------------------- data
def is_validation(relpath: str, percent: int) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def read_split(percent: int) -> tuple[list[str], list[str], list[str]]:
    train, val, val_names = [], [], []
    for rel, path in stdlib_sources(SKIPPED_DIRS):
        text = path.read_text(encoding="utf-8", errors="replace")
        if is_validation(rel, percent):
            val.append(text)
            val_names.append(rel)
        else:
            train.append(text)
    return train, val, val_names


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------- models
def make_model(shape: dict, vocab: int, eos: int, seq_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos,
                         rope_theta=10000.0, attn_implementation="sdpa", **shape)
    return LlamaForCausalLM(config)


def lr_at(step: int, s: Settings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_pair(stream: np.ndarray, s: Settings, vocab: int, eos: int, log) -> tuple:
    torch.manual_seed(s.seed)
    target = make_model(TARGET_SHAPE, vocab, eos, s.seq_len)
    draft = make_model(DRAFT_SHAPE, vocab, eos, s.seq_len)
    opts = [torch.optim.AdamW(m.parameters(), lr=s.lr, betas=(0.9, 0.95),
                              weight_decay=s.weight_decay) for m in (target, draft)]
    rng = np.random.default_rng(s.seed)
    history = []
    start = time.time()
    for step in range(s.steps):
        offsets = rng.integers(0, len(stream) - s.seq_len - 1, size=s.batch_size)
        batch = torch.from_numpy(np.stack([stream[o:o + s.seq_len + 1] for o in offsets]))
        inputs, labels = batch[:, :-1], batch[:, 1:]
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s)

        t_logits = target(input_ids=inputs).logits  # [B, T, V]
        t_loss = F.cross_entropy(t_logits.reshape(-1, vocab), labels.reshape(-1))
        d_logits = draft(input_ids=inputs).logits
        d_ce = F.cross_entropy(d_logits.reshape(-1, vocab), labels.reshape(-1))
        teacher = F.log_softmax(t_logits.detach().reshape(-1, vocab), dim=-1)
        d_kl = F.kl_div(F.log_softmax(d_logits.reshape(-1, vocab), dim=-1), teacher,
                        log_target=True, reduction="batchmean")
        d_loss = (1 - s.distill_weight) * d_ce + s.distill_weight * d_kl

        for model, opt, loss in ((target, opts[0], t_loss), (draft, opts[1], d_loss)):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % 50 == 0 or step == s.steps - 1:
            row = dict(step=step, target_loss=round(t_loss.item(), 4),
                       draft_ce=round(d_ce.item(), 4), draft_kl=round(d_kl.item(), 4),
                       elapsed_s=round(time.time() - start, 1))
            history.append(row)
            log(json.dumps(row))
    return target.eval(), draft.eval(), history, time.time() - start


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def validation_loss(model, stream: np.ndarray, windows: int, seq_len: int) -> float:
    losses = []
    for i in range(windows):
        chunk = torch.from_numpy(stream[i * seq_len:(i + 1) * seq_len + 1]).unsqueeze(0)
        if chunk.shape[1] < seq_len + 1:
            break
        logits = model(input_ids=chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0], chunk[0, 1:]).item())
    return float(np.mean(losses)), len(losses)


@torch.no_grad()
def greedy_speculative(target, draft, prompt: list[int], k: int, new_tokens: int):
    """Reference greedy SpD by full recomputation: returns tokens, target calls, accepts."""
    seq = list(prompt)
    calls, accepted_per_pos = 0, [0] * k
    while len(seq) - len(prompt) < new_tokens:
        proposal = []
        for _ in range(k):
            logits = draft(input_ids=torch.tensor([seq + proposal])).logits[0, -1]
            proposal.append(int(logits.argmax()))
        logits = target(input_ids=torch.tensor([seq + proposal])).logits[0, -k - 1:]
        verdict = logits.argmax(-1).tolist()
        calls += 1
        n = 0
        while n < k and proposal[n] == verdict[n]:
            accepted_per_pos[n] += 1
            n += 1
        seq += proposal[:n] + [verdict[n]]
    return seq[len(prompt):len(prompt) + new_tokens], calls, accepted_per_pos


@torch.no_grad()
def greedy_target_only(target, prompt: list[int], new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def eval_prompts(val_texts: list[str], tok: Tokenizer, s: Settings) -> list[dict]:
    rng = random.Random(s.seed)
    prompts = []
    candidates = [t for t in val_texts if len(t) > 4000]
    while len(prompts) < s.eval_prompts:
        text = candidates[len(prompts) % len(candidates)]
        ids = tok.encode(text).ids
        start = rng.randrange(0, len(ids) - s.eval_prompt_tokens - s.eval_new_tokens)
        window = ids[start:start + s.eval_prompt_tokens]
        prompts.append({"text": tok.decode(window)})
    return prompts


def measure_agreement(target, draft, tok: Tokenizer, prompts: list[dict], s: Settings) -> dict:
    tokens, calls, per_pos, matches = 0, 0, [0] * s.eval_k, 0
    for p in prompts:
        ids = tok.encode(p["text"]).ids
        out, n_calls, acc = greedy_speculative(target, draft, ids, s.eval_k, s.eval_new_tokens)
        matches += out == greedy_target_only(target, ids, s.eval_new_tokens)
        tokens += len(out)
        calls += n_calls
        per_pos = [a + b for a, b in zip(per_pos, acc)]
    return {"k": s.eval_k, "prompts": len(prompts), "new_tokens": s.eval_new_tokens,
            "tokens_per_target_call": round(tokens / calls, 3),
            "acceptance_per_position": [round(a / calls, 3) for a in per_pos],
            "matches_target_only_greedy": f"{matches}/{len(prompts)}"}


# ---------------------------------------------------------------- output
def save_model(model, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(out, safe_serialization=True)
    model.float()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                            pad_token=EOS, model_max_length=2048).save_pretrained(out)


def write_card(path: Path, role: str, shape: dict, params: int, results: dict) -> None:
    s = results["settings"]
    lines = [
        f"# qpcbuild demo {role}",
        "",
        "A small Llama-architecture model trained by `scripts/train_demo_pair.py` so that qpcbuild",
        "can build and run speculative-decoding bundles offline. It writes Python-ish code; it is a",
        "test fixture, not a useful assistant.",
        "",
        f"- Data: Python {results['python']} standard library sources (test folders skipped),",
        f"  {results['train_files']} training files, {results['val_files']} held-out files "
        f"({s['validation_percent']}% by path hash), {results['train_tokens']:,} training tokens.",
        f"- Tokenizer: byte-level BPE, vocab {s['vocab_size']}, `{EOS}` is BOS/EOS/PAD (id 0).",
        f"- Shape: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, "
        f"MLP {shape['intermediate_size']}, tied embeddings, {params:,} parameters; "
        "weights stored as float16.",
        f"- Training: {s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens, AdamW, "
        f"peak lr {s['lr']}, seed {s['seed']}, {results['train_seconds']:.0f} s on "
        f"{results['machine']}.",
        f"- Validation loss (nats/token, mean over {results['val_windows']} windows of "
        f"{s['seq_len']} held-out tokens): target {results['target_val_loss']:.3f}, "
        f"draft {results['draft_val_loss']:.3f}.",
        f"- Draft agreement (greedy SpD, K={results['agreement']['k']}, "
        f"{results['agreement']['prompts']} held-out prompts, "
        f"{results['agreement']['new_tokens']} new tokens): "
        f"{results['agreement']['tokens_per_target_call']} tokens per target call; "
        f"acceptance by position {results['agreement']['acceptance_per_position']}.",
    ]
    if role == "draft":
        lines.append(f"- The draft was trained with {s['distill_weight']:.0%} of its loss as "
                     "KL divergence to the target's predictions (distillation).")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "models/demo")
    ap.add_argument("--steps", type=int, default=Settings.steps)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    s = Settings(steps=args.steps)
    torch.set_num_threads(args.threads)
    random.seed(s.seed)
    np.random.seed(s.seed)
    def log(msg: str) -> None:
        print(msg, flush=True)

    train_texts, val_texts, val_names = read_split(s.validation_percent)
    log(f"{len(train_texts)} training files, {len(val_texts)} validation files")
    tok = train_tokenizer(train_texts, s.vocab_size)
    eos = tok.token_to_id(EOS)
    train_stream, val_stream = token_stream(tok, train_texts), token_stream(tok, val_texts)
    log(f"{len(train_stream):,} training tokens, {len(val_stream):,} validation tokens")

    target, draft, history, seconds = train_pair(train_stream, s, tok.get_vocab_size(), eos, log)
    # Evaluate the float16 weights that are shipped, not the float32 ones in memory.
    target, draft = target.half().float(), draft.half().float()
    t_loss, windows = validation_loss(target, val_stream, s.eval_windows, s.seq_len)
    d_loss, _ = validation_loss(draft, val_stream, s.eval_windows, s.seq_len)
    prompts = eval_prompts(val_texts, tok, s)
    agreement = measure_agreement(target, draft, tok, prompts, s)
    results = dict(settings=asdict(s), python=platform.python_version(),
                   machine=f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
                   train_files=len(train_texts), val_files=len(val_texts),
                   validation_file_names=val_names, train_tokens=int(len(train_stream)),
                   train_seconds=round(seconds, 1), val_windows=windows,
                   target_val_loss=round(t_loss, 4), draft_val_loss=round(d_loss, 4),
                   agreement=agreement, history=history)
    log(json.dumps({k: v for k, v in results.items() if k not in ("history", "validation_file_names")}))

    for role, model, shape in (("target", target, TARGET_SHAPE), ("draft", draft, DRAFT_SHAPE)):
        save_model(model, tok, args.out / role)
        params = sum(p.numel() for p in model.parameters())
        write_card(args.out / role / "README.md", role, shape, params, results)
    (args.out / "training.json").write_text(json.dumps(results, indent=1) + "\n")
    with open(args.out / "eval_prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
