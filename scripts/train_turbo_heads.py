"""Train turbo (multi-projection) draft heads for SmolLM2-135M-Instruct by self-distillation.

A turbo head reads the target's own last hidden state (after the final norm) and predicts a
token further ahead: head h (0-based) at position t predicts the token at t + 2 + h (the base
LM head predicts t + 1). Each head is `--layers` repeats of one ResBlock x + SiLU(W x + b)
(weights shared within a head, W zero-initialised, as QEfficient's turbo.py builds them), and
its output goes through the target's frozen LM head. Written in QEfficient's format:
`speculator_config.json` ({"turbo_num_layers", "turbo_num_heads"}) and
`speculator.safetensors` (keys `projections.<head>.<layer>.linear.weight|bias`, every repeat of
a head stored, equal).

Data: (1) the prompts of scripts/train_smollm2_draft.py (stdlib code, template chat questions in
the target's chat template, template prose; 10% held out by hash), continued GREEDILY by the
target itself until --gen-minutes is spent; the labels are the target's own tokens, so a head
learns what the target will say (what greedy verification accepts). (2) As generation on this
shared CPU is slow (about 10 tokens/s), windows of standard-library source read by the target
in one pass each until --tf-minutes, labelled with the target's own greedy prediction at every
position. Evaluation uses the held-out generated continuations only. Training: cross-entropy of each
head's logits over the rows of the LM head listed in models/smollm2-draft/draft_vocab.json (the
8,192 tokens most frequent in the target's continuations: 6x less work per step than the full
vocabulary; labels outside it are skipped), Adam, cosine schedule, until --steps or
--train-minutes. Evaluation: top-1 agreement per head position over the FULL vocabulary on the
held-out prompts' continuations.

Run:  python scripts/train_turbo_heads.py                  # the defaults are what was run
      python scripts/train_turbo_heads.py --gen-minutes 0.5 --steps 5 --out /tmp/heads
Needs torch and transformers (the `dev` extra) and the converted target (make smollm2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from stdlib_corpus import stdlib_sources  # scripts/ is on sys.path when a script runs
from train_smollm2_draft import (SKIPPED_DIRS, build_prompts, load_target, load_tokenizer,
                                 log)

ROOT = Path(__file__).resolve().parents[1]


def generate(args, target, tok, prompts: list[dict], with_hidden: bool = True) -> list[dict]:
    """Greedy continuations by the target in left-padded batches until the time budget; each
    sequence with its final-norm hidden states (one teacher-forced pass) when `with_hidden`."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = tok.eos_token_id
    rng = random.Random(args.seed)
    order = prompts[:]
    rng.shuffle(order)
    seqs: list[dict] = []
    t0 = time.time()
    for start in range(0, len(order), args.gen_batch):
        if time.time() - t0 > args.gen_minutes * 60:
            break
        batch = order[start:start + args.gen_batch]
        width = max(len(p["ids"]) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p["ids"]):] = torch.tensor(p["ids"])
            mask[r, width - len(p["ids"]):] = 1
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=args.gen_new_tokens, pad_token_id=pad)
        for r, p in enumerate(batch):
            cont = out[r, width:].tolist()
            if eos in cont:
                cont = cont[:cont.index(eos) + 1]
            seq = p["ids"] + cont
            hidden = None
            if with_hidden:
                with torch.no_grad():
                    hidden = target.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
                hidden = hidden.half()
            seqs.append({"kind": p["kind"], "heldout": p["heldout"], "tokens": seq,
                         "prompt_len": len(p["ids"]), "hidden": hidden})
        log(f"generated {len(seqs)} sequences ({time.time() - t0:.0f} s)")
    return seqs


def teacher_forced(args, target, tok) -> list[dict]:
    """Windows of standard-library source read by the target in one pass each (batches of 16),
    until --tf-minutes: the hidden states at every position, and as labels the target's OWN
    greedy prediction at each position (so head h at t learns the target's choice for t + 2 + h
    given the text up to t + 1 + h: on-policy up to the text the window conditions on).
    Stored like a generated sequence: tokens[j] = the target's prediction at j - 1."""
    import torch

    files = stdlib_sources(SKIPPED_DIRS)
    random.Random(args.seed + 7).shuffle(files)
    seqs: list[dict] = []
    t0 = time.time()
    batch: list[list[int]] = []
    for _, path in files:
        if time.time() - t0 > args.tf_minutes * 60:
            break
        try:
            ids = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) < args.tf_len:
            continue
        start = random.Random(f"{args.seed}:{path}").randrange(len(ids) - args.tf_len + 1)
        batch.append(ids[start:start + args.tf_len])
        if len(batch) < 16:
            continue
        with torch.no_grad():
            hidden = target.model(input_ids=torch.tensor(batch)).last_hidden_state
            pred = target.lm_head(hidden).argmax(-1)
        for row, h in zip(pred.tolist(), hidden):
            seqs.append({"kind": "stdlib", "heldout": False, "tokens": [0] + row,
                         "prompt_len": 1, "hidden": h.half()})
        batch = []
    log(f"teacher-forced {len(seqs)} windows of {args.tf_len} ({time.time() - t0:.0f} s)")
    return seqs


def examples(seqs: list[dict], heads: int, first: str = "prompt_end"):
    """(hidden [N, H] float32, labels [N, heads] with -1 where the sequence ends), over the
    positions from the prompt's last token on (where proposals are made)."""
    import torch

    hs, labels = [], []
    for s in seqs:
        toks, n = s["tokens"], len(s["tokens"])
        start = s["prompt_len"] - 1
        if start >= n - 2:
            continue
        hs.append(s["hidden"][start:n - 2].float())
        lab = torch.full((n - 2 - start, heads), -1, dtype=torch.long)
        for t in range(start, n - 2):
            for h in range(heads):
                if t + 2 + h < n:
                    lab[t - start, h] = toks[t + 2 + h]
        labels.append(lab)
    return torch.cat(hs), torch.cat(labels)


class Heads:
    """`heads` ResBlocks, each applied `layers` times (shared weights)."""

    def __init__(self, heads: int, layers: int, hidden: int):
        import torch

        self.layers = layers
        self.w = [torch.zeros(hidden, hidden, requires_grad=True) for _ in range(heads)]
        self.b = [torch.zeros(hidden, requires_grad=True) for _ in range(heads)]

    def params(self) -> list:
        return self.w + self.b

    def __call__(self, x, h: int):
        import torch.nn.functional as F

        for _ in range(self.layers):
            x = x + F.silu(x @ self.w[h].T + self.b[h])
        return x


def train(args, heads: Heads, lm_head, x, y, subset):
    """Cross-entropy over the subset rows of the LM head, per head."""
    import math

    import torch
    import torch.nn.functional as F

    column = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
    column[subset] = torch.arange(len(subset))
    lm_sub = lm_head[subset]  # [Vs, H]
    y_sub = torch.where(y >= 0, column[y.clamp(min=0)], torch.full_like(y, -1))
    opt = torch.optim.Adam(heads.params(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    history, t0, step = [], time.time(), 0
    for step in range(1, args.steps + 1):
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, len(x), (args.batch,), generator=gen)
        xb, yb = x[pick], y_sub[pick]
        loss = 0.0
        for h in range(len(heads.w)):
            logits = heads(xb, h) @ lm_sub.T
            loss = loss + F.cross_entropy(logits, yb[:, h], ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == 1:
            history.append({"step": step, "loss": round(loss.item() / len(heads.w), 4)})
            log(f"step {step} loss/head {loss.item() / len(heads.w):.3f} "
                f"({time.time() - t0:.0f} s)")
        if time.time() - t0 > args.train_minutes * 60:
            break
    return history, step, time.time() - t0


def top1(heads: Heads, lm_head, x, y) -> list[float]:
    """Per head: how often its full-vocabulary argmax is the target's token."""
    import torch

    out = []
    with torch.no_grad():
        for h in range(len(heads.w)):
            valid = y[:, h] >= 0
            hits, total = 0, 0
            for i in range(0, len(x), 512):
                xs, ys, v = x[i:i + 512], y[i:i + 512, h], valid[i:i + 512]
                pred = (heads(xs, h) @ lm_head.T).argmax(-1)
                hits += int(((pred == ys) & v).sum())
                total += int(v.sum())
            out.append(round(hits / max(total, 1), 4))
    return out



def write(args, heads: Heads, record: dict) -> None:
    import torch
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for h in range(len(heads.w)):
        for layer in range(args.layers):  # every repeat stored, as the module's state dict has it
            tensors[f"projections.{h}.{layer}.linear.weight"] = heads.w[h].detach().clone().contiguous()
            tensors[f"projections.{h}.{layer}.linear.bias"] = heads.b[h].detach().clone().contiguous()
    save_file({k: v.to(torch.float32) for k, v in tensors.items()},
              str(args.out / "speculator.safetensors"))
    (args.out / "speculator_config.json").write_text(json.dumps(
        {"turbo_num_layers": args.layers, "turbo_num_heads": args.heads}, indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def add_data_args(ap: argparse.ArgumentParser, gen_minutes: float) -> None:
    """The options of the target, the prompts and their generation (shared with
    scripts/train_eagle3_head.py, which makes its data with `generate`)."""
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--vocab", type=Path,
                    default=ROOT / "models" / "smollm2-draft" / "draft_vocab.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--code-prompts", type=int, default=1400)
    ap.add_argument("--heldout-percent", type=int, default=10)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-minutes", type=float, default=gen_minutes)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--gen-new-tokens", type=int, default=96)
    ap.add_argument("--tf-len", type=int, default=128)


def frozen_target(args):
    """Torch on --threads, seeded; the tokenizer and the target with its weights frozen (shared
    with scripts/train_eagle3_head.py); None, after saying why, when the target is missing."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if not (args.target / "config.json").is_file():
        print(f"error: {args.target} has no config.json; run scripts/get_smollm2.py first",
              file=sys.stderr)
        return None
    tok = load_tokenizer(args.target)
    target = load_target(args.target)
    for p in target.parameters():
        p.requires_grad_(False)
    return tok, target


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap, gen_minutes=4.0)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-turbo")
    ap.add_argument("--tf-minutes", type=float, default=4.0)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train-minutes", type=float, default=8.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    loaded = frozen_target(args)
    if loaded is None:
        return 2
    tok, target = loaded
    import torch
    prompts = build_prompts(tok, args)
    # held-out prompts are generated too (a share of the budget), for the evaluation
    t0 = time.time()
    seqs = generate(args, target, tok, prompts)
    gen_s = time.time() - t0
    tf = teacher_forced(args, target, tok)
    train_seqs = [s for s in seqs if not s["heldout"]] + tf
    eval_seqs = [s for s in seqs if s["heldout"]]
    x, y = examples(train_seqs, args.heads)
    ex, ey = examples(eval_seqs, args.heads)
    lm_head = target.lm_head.weight.detach()
    subset = torch.tensor(json.loads(args.vocab.read_text())["token_ids"], dtype=torch.long)
    log(f"{len(x)} training positions, {len(ex)} held-out positions")
    heads = Heads(args.heads, args.layers, x.shape[1])
    before = top1(heads, lm_head, ex, ey)
    history, steps, train_s = train(args, heads, lm_head, x, y, subset)
    after = top1(heads, lm_head, ex, ey)
    kinds: dict[str, int] = {}
    for s in seqs:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    record = {
        "script": "scripts/train_turbo_heads.py",
        "args": {k: str(v).replace(f"{ROOT}/", "") for k, v in vars(args).items()},
        "target": str(args.target.name),
        "data": {"sequences": len(seqs), "by_kind": kinds, "teacher_forced_windows": len(tf),
                 "train_positions": int(len(x)),
                 "heldout_sequences": len(eval_seqs), "heldout_positions": int(len(ex)),
                 "generation_seconds": round(gen_s, 1)},
        "training": {"steps": steps, "seconds": round(train_s, 1), "history": history},
        "heldout_top1_per_head": {"before": before, "after": after},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": args.threads, "cpu": platform.machine()},
    }
    write(args, heads, record)
    log(f"held-out top-1 per head position: {before} -> {after}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
