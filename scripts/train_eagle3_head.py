"""Train an EAGLE-3 draft head for SmolLM2-135M-Instruct by self-distillation.

The head (the speculators format, models/eagle3_head.py in qpcbuild reads it) is one Llama
decoder layer whose attention reads [norm(embed(token)); norm(g)] (2H wide), where g is either
fc(concat of the target's hidden states entering layers 2, L//2, L-3) for a position the target
has verified, or the head's own previous output while it drafts ahead. Its output goes through
`norm` and a draft-vocabulary LM head; d2t maps draft ids back to target ids.

Data, all labelled with the TARGET's own greedy choice at every position (what greedy
verification accepts): (1) the prompts of scripts/train_smollm2_draft.py continued greedily by
the target (train_turbo_heads.generate, 10% of prompts held out by hash) until --gen-minutes;
(2) --tf-windows windows of standard-library source, one per file. One more pass
per sequence gives the three auxiliary hidden states and the labels.

Training-time test: each step unrolls --unroll drafting steps. Step 0 pairs the token at t + 1
with the target's feature at t (EAGLE's shift) and predicts the target's token at t + 2; step j
feeds the head's own output of step j - 1 at the same base position with the token at t + 1 + j,
at position t + j, attending to step 0's keys up to t and to its own earlier steps' keys at t
(the keys the head will really have written while drafting). Loss: cross-entropy over the draft
vocabulary (models/smollm2-draft/draft_vocab.json, the 8,192 tokens most frequent in the
target's continuations), summed over the steps.

Initialisation: the layer from the target's layer L-3 (its q/k/v read the hidden half; the
embedding half starts at zero), fc picks the deepest feature, norm and lm_head rows from the
target: the head starts as a shortened target and learns to use the next token's embedding.

Later stages (--init): continue from a trained head on new data (another --seed draws other
prompts and windows; the held-out 10% is chosen by a hash of each prompt, so no stage trains on
another's held-out prompts).

Run (models/smollm2-eagle3 is these three stages, models/smollm2-eagle3/README.md):
      python scripts/train_eagle3_head.py --out /tmp/stage1          # stage 1: the defaults
      python scripts/train_eagle3_head.py --init /tmp/stage1 --out /tmp/stage2 --seed 4321 \
          --code-prompts 2400 --gen-minutes 25 --gen-batch 64 --tf-windows 1200 \
          --tf-per-file 2 --train-minutes 25 --lr 5e-4 --checkpoint-minutes 8
      python scripts/train_eagle3_head.py --init /tmp/stage2 --out /tmp/stage3 --seed 777 \
          --code-prompts 300 --gen-minutes 13 --gen-batch 64 --tf-windows 300 \
          --train-minutes 15 --lr 3e-4 --checkpoint-minutes 5    # every chat and prose prompt
      python scripts/train_eagle3_head.py --gen-minutes 0.3 --tf-windows 8 --steps 3 --out /tmp/h
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

from stdlib_corpus import stdlib_sources  # scripts/ is on sys.path when a script runs
from train_smollm2_draft import SKIPPED_DIRS, build_prompts, log
from train_turbo_heads import add_data_args, frozen_target, generate

ROOT = Path(__file__).resolve().parents[1]


def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: the inputs of layers 2, L // 2 and L - 3."""
    return [2, num_layers // 2, num_layers - 3]


def features(target, seqs: list[list[int]], layer_ids: list[int], batch: int = 16):
    """Per sequence: (tokens, aux features [n, 3H] float16, target's greedy choice per position
    [n] with -1 at 0), by one pass over right-padded batches of similar length (causal
    attention: the padding after a sequence changes nothing before it)."""
    import torch

    out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    with torch.no_grad():
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            width = max(len(seqs[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
            res = target(input_ids=ids, output_hidden_states=True)
            aux = torch.cat([res.hidden_states[j] for j in layer_ids], dim=-1)
            best = res.logits.argmax(-1)
            for r, i in enumerate(rows):
                n = len(seqs[i])
                choice = torch.full((n,), -1, dtype=torch.long)
                choice[1:] = best[r, :n - 1]
                out[i] = (torch.tensor(seqs[i]), aux[r, :n].half(), choice)
    return out


def stdlib_windows(args, tok) -> list[list[int]]:
    """--tf-windows windows of --tf-len tokens of standard-library source, one per file at a
    seeded offset (the target reads them in `features`)."""
    files = stdlib_sources(SKIPPED_DIRS)
    random.Random(args.seed + 7).shuffle(files)
    windows = []
    for _, path in files:
        if len(windows) >= args.tf_windows:
            break
        try:
            ids = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        except (UnicodeDecodeError, OSError):
            continue
        for k in range(args.tf_per_file):
            if len(ids) < args.tf_len or len(windows) >= args.tf_windows:
                break
            # the first offset of a file is the one earlier runs drew (same seed string)
            where = f"{args.seed}:{path}" + (f":{k}" if k else "")
            start = random.Random(where).randrange(len(ids) - args.tf_len + 1)
            windows.append(ids[start:start + args.tf_len])
    return windows


class Eagle3Head:
    """The head's trainable tensors (names as the speculators format stores them) and forward."""

    def __init__(self, target, layer_ids: list[int], draft_ids, cfg: dict):
        import torch

        t = target.model
        src = t.layers[layer_ids[-1]]
        h = cfg["hidden_size"]
        p: dict[str, torch.Tensor] = {}
        fc = torch.zeros(h, 3 * h)
        fc[:, 2 * h:] = torch.eye(h)  # the deepest feature passes through at first
        p["fc.weight"] = fc
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight.detach()
            p[f"layers.0.self_attn.{name}.weight"] = torch.cat([torch.zeros_like(w), w], 1)
        p["layers.0.self_attn.o_proj.weight"] = src.self_attn.o_proj.weight.detach().clone()
        for name in ("gate_proj", "up_proj", "down_proj"):
            p[f"layers.0.mlp.{name}.weight"] = getattr(src.mlp, name).weight.detach().clone()
        p["layers.0.input_layernorm.weight"] = torch.ones(h)
        p["layers.0.hidden_norm.weight"] = src.input_layernorm.weight.detach().clone()
        p["layers.0.post_attention_layernorm.weight"] = \
            src.post_attention_layernorm.weight.detach().clone()
        p["norm.weight"] = t.norm.weight.detach().clone()
        p["lm_head.weight"] = target.lm_head.weight.detach()[draft_ids].clone()
        self.p = {k: v.float().requires_grad_(True) for k, v in p.items()}
        self.embed = t.embed_tokens.weight.detach()
        self.cfg = cfg
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**cfg))

    def norm(self, x, name: str):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * (var + self.cfg["rms_norm_eps"]).rsqrt() * self.p[name]

    def qkv(self, tokens, g, pos):
        """q [B, nH, T, D], k, v [B, nKV, T, D] with RoPE at `pos` [B, T]."""
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        c, p = self.cfg, self.p
        x = self.embed[tokens]
        z = torch.cat([self.norm(x, "layers.0.input_layernorm.weight"),
                       self.norm(g, "layers.0.hidden_norm.weight")], -1)
        b, t = tokens.shape
        d = c["head_dim"]
        q = (z @ p["layers.0.self_attn.q_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
        k = (z @ p["layers.0.self_attn.k_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
        v = (z @ p["layers.0.self_attn.v_proj.weight"].T).view(b, t, -1, d).transpose(1, 2)
        cos, sin = self.rotary(v, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, g, attn):
        """Residual (the un-normed g), the MLP block: the step's output [B, T, H]."""
        import torch.nn.functional as F

        p = self.p
        x = g + attn @ p["layers.0.self_attn.o_proj.weight"].T
        n = self.norm(x, "layers.0.post_attention_layernorm.weight")
        m = F.silu(n @ p["layers.0.mlp.gate_proj.weight"].T) * (n @ p["layers.0.mlp.up_proj.weight"].T)
        return x + m @ p["layers.0.mlp.down_proj.weight"].T

    def logits(self, out):
        return self.norm(out, "norm.weight") @ self.p["lm_head.weight"].T

    def unroll(self, tokens, aux, steps: int):
        """tokens [B, T + steps], aux [B, T, 3H] -> per step the draft logits [B, T, Vd] at
        base positions 0..T-1 (step j: token at t + 1 + j, position t + j)."""
        import torch

        b, t = aux.shape[:2]
        c = self.cfg
        groups = c["num_attention_heads"] // c["num_key_value_heads"]
        g = aux @ self.p["fc.weight"].T
        base = torch.arange(t).unsqueeze(0).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        keys, values, outs = [], [], []
        for j in range(steps):
            q, k, v = self.qkv(tokens[:, 1 + j:1 + j + t], g, base + j)
            keys.append(k.repeat_interleave(groups, 1))
            values.append(v.repeat_interleave(groups, 1))
            scale = 1.0 / math.sqrt(c["head_dim"])
            full = (q @ keys[0].transpose(-1, -2)) * scale  # step 0's keys, causal
            full = full.masked_fill(~causal, float("-inf"))
            diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # own earlier
            w = torch.softmax(torch.cat([full, *diag], -1), -1)
            attn = w[..., :t] @ values[0]
            for i, vv in enumerate(values[1:]):
                attn = attn + w[..., t + i:t + i + 1] * vv
            attn = attn.transpose(1, 2).reshape(b, t, -1)
            g = self.finish(g, attn)
            outs.append(self.logits(g))
        return outs


def batches(data, window: int, steps: int, batch: int, gen):
    """Random windows: tokens [B, window + steps], aux [B, window, 3H], labels [B, window +
    steps + 1] as target choices aligned to positions."""
    import torch

    usable = [d for d in data if len(d[0]) >= window + steps + 2]
    pick = torch.randint(0, len(usable), (batch,), generator=gen).tolist()
    toks, auxs, labs = [], [], []
    for i in pick:
        ids, aux, choice = usable[i]
        s = int(torch.randint(0, len(ids) - window - steps - 1, (1,), generator=gen))
        toks.append(ids[s:s + window + steps])
        auxs.append(aux[s:s + window].float())
        labs.append(choice[s:s + window + steps + 2])
    return torch.stack(toks), torch.stack(auxs), torch.stack(labs)


def step_labels(labs, column, window: int, j: int):
    """Step j at base t predicts the target's choice at t + 2 + j, in draft columns (-1: none)."""
    import torch

    y = labs[:, 2 + j:2 + j + window]
    return torch.where(y >= 0, column[y.clamp(min=0)], torch.full_like(y, -1))


def evaluate(head, data, column, window: int, steps: int) -> list[float]:
    """Top-1 per drafting step over the held-out sequences (draft-vocabulary argmax mapped to
    target ids must equal the target's choice; a label outside the draft vocab counts a miss)."""
    import torch

    hits, total = [0] * steps, [0] * steps
    with torch.no_grad():
        for ids, aux, choice in data:
            n = len(ids)
            w = n - steps - 2
            if w < 2:
                continue
            outs = head.unroll(ids[None, :w + steps], aux[None, :w].float(), steps)
            for j, lg in enumerate(outs):
                y = choice[2 + j:2 + j + w]
                pred_col = lg[0].argmax(-1)
                hit = (column[y.clamp(min=0)] == pred_col) & (y >= 0)
                hits[j] += int(hit.sum())
                total[j] += int((y >= 0).sum())
    return [round(h / max(t, 1), 4) for h, t in zip(hits, total)]


def warm_start(head: Eagle3Head, folder: Path, draft_ids, layer_ids: list[int]) -> None:
    """Replace the shortened-target start with a trained head's tensors (a second stage of
    training on new data); a head for other aux layers or another draft vocabulary is refused."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if config.get("eagle_aux_hidden_state_layer_ids") != layer_ids:
        raise SystemExit(f"error: {folder}: aux layers {config.get('eagle_aux_hidden_state_layer_ids')}"
                         f" are not {layer_ids}")
    tensors = load_file(str(folder / "model.safetensors"))
    d2t = tensors.pop("d2t")
    if not torch.equal(torch.arange(len(d2t)) + d2t, draft_ids):
        raise SystemExit(f"error: {folder}: its draft vocabulary is not --vocab's")
    if set(tensors) != set(head.p):
        raise SystemExit(f"error: {folder}: tensors {sorted(set(tensors) ^ set(head.p))} differ")
    for name, value in tensors.items():
        head.p[name] = value.float().requires_grad_(True)
    log(f"warm start from {folder}")


def write(args, head: Eagle3Head, draft_ids, layer_ids, record: dict) -> None:
    import torch
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in head.p.items()}
    tensors["d2t"] = (draft_ids - torch.arange(len(draft_ids))).to(torch.int64)
    save_file(tensors, str(args.out / "model.safetensors"))
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "draft_vocab_size": len(draft_ids), "norm_before_residual": False,
              "target_hidden_size": head.cfg["hidden_size"],
              "eagle_aux_hidden_state_layer_ids": layer_ids,
              "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1,
                                           **head.cfg}}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    add_data_args(ap, gen_minutes=16.0)
    ap.set_defaults(threads=2, gen_batch=32)  # this script's run had the machine to itself
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-eagle3")
    ap.add_argument("--tf-windows", type=int, default=600)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-minutes", type=float, default=35.0)
    ap.add_argument("--checkpoint-minutes", type=float, default=10.0)
    ap.add_argument("--tf-per-file", type=int, default=1,
                    help="stdlib windows drawn per file (seeded offsets)")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue from this head folder's weights instead of the shortened "
                         "target (same target, aux layers and draft vocabulary)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    loaded = frozen_target(args)
    if loaded is None:
        return 2
    tok, target = loaded
    import torch
    tc = target.config
    layer_ids = aux_layer_ids(tc.num_hidden_layers)
    cfg = {"hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
           "num_attention_heads": tc.num_attention_heads,
           "num_key_value_heads": tc.num_key_value_heads, "head_dim": tc.head_dim,
           "rms_norm_eps": tc.rms_norm_eps, "rope_theta": float(tc.rope_parameters["rope_theta"]),
           "max_position_embeddings": tc.max_position_embeddings, "vocab_size": tc.vocab_size,
           "hidden_act": "silu"}
    t0 = time.time()
    seqs = generate(args, target, tok, build_prompts(tok, args), with_hidden=False)
    gen_s = time.time() - t0
    windows = stdlib_windows(args, tok)
    t1 = time.time()
    train = features(target, [s["tokens"] for s in seqs if not s["heldout"]] + windows, layer_ids)
    heldout = features(target, [s["tokens"] for s in seqs if s["heldout"]], layer_ids)
    feat_s = time.time() - t1
    log(f"{len(train)} training sequences ({sum(len(d[0]) for d in train)} positions), "
        f"{len(heldout)} held out; features {feat_s:.0f} s")
    draft_ids = torch.tensor(json.loads(args.vocab.read_text())["token_ids"], dtype=torch.long)
    column = torch.full((tc.vocab_size,), -1, dtype=torch.long)
    column[draft_ids] = torch.arange(len(draft_ids))
    head = Eagle3Head(target, layer_ids, draft_ids, cfg)
    if args.init is not None:
        warm_start(head, args.init, draft_ids, layer_ids)
    before = evaluate(head, heldout, column, args.window, args.unroll)
    log(f"held-out top-1 per step before training: {before}")
    opt = torch.optim.AdamW(list(head.p.values()), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    history, t2, step = [], time.time(), 0
    last_save = t2
    budget = args.train_minutes * 60
    for step in range(1, args.steps + 1):
        frac = min(1.0, (time.time() - t2) / budget)
        for group in opt.param_groups:  # cosine over the time budget
            group["lr"] = args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        toks, aux, labs = batches(train, args.window, args.unroll, args.batch, gen)
        outs = head.unroll(toks, aux, args.unroll)
        loss = sum(torch.nn.functional.cross_entropy(
            lg.reshape(-1, lg.shape[-1]), step_labels(labs, column, args.window, j).reshape(-1),
            ignore_index=-1) for j, lg in enumerate(outs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == 1:
            history.append({"step": step, "loss": round(loss.item() / args.unroll, 4)})
            log(f"step {step} loss/step {loss.item() / args.unroll:.3f} "
                f"({time.time() - t2:.0f} s)")
        if time.time() - last_save > args.checkpoint_minutes * 60:
            # a run cut short (a shared machine, a time limit) still leaves a usable head
            write(args, head, draft_ids, layer_ids, {"partial": True, "step": step})
            last_save = time.time()
        if time.time() - t2 > budget:
            break
    train_s = time.time() - t2
    after = evaluate(head, heldout, column, args.window, args.unroll)
    record = {
        "script": "scripts/train_eagle3_head.py",
        "args": {k: str(v).replace(f"{ROOT}/", "") for k, v in vars(args).items()},
        "target": str(args.target.name),
        "data": {"generated_sequences": len(seqs), "stdlib_windows": len(windows),
                 "train_sequences": len(train),
                 "train_positions": sum(len(d[0]) for d in train),
                 "heldout_sequences": len(heldout),
                 "heldout_positions": sum(len(d[0]) for d in heldout),
                 "generation_seconds": round(gen_s, 1), "feature_seconds": round(feat_s, 1)},
        "training": {"steps": step, "seconds": round(train_s, 1), "history": history},
        "heldout_top1_per_draft_step": {"before": before, "after": after},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": args.threads, "cpu": platform.machine(),
                        "note": "shared 2-core machine"},
    }
    write(args, head, draft_ids, layer_ids, record)
    log(f"held-out top-1 per draft step: {before} -> {after}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
