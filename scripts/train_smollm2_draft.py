"""Train a small draft model for SmolLM2-135M-Instruct by on-policy distillation, on CPU.

Target: models/smollm2-135m-instruct (made by scripts/get_smollm2.py). Draft: a tiny
LlamaForCausalLM with the *same* tokenizer and vocab (49152), tied embeddings, and its
embedding matrix initialised from the target's by truncated SVD (PCA without centering) to the
draft's hidden size; that head start matters because the 49152-row LM head is most of the
draft's parameters and most of its per-call cost.

Phases (all resumable; intermediate files live in --work):
  gen    build the prompt set (code: beginnings of functions from this interpreter's standard
         library; chat: template-made questions wrapped in the target's chat template), hold out
         10% of the prompts (by hash) for evaluation, and let the TARGET continue the rest
         (greedy, and some sampled at temperature 0.7) in left-padded batches until the
         --gen-minutes budget is spent. For every sequence the target's top-k next-token
         log-probs are stored (teacher-forced pass), for prompt and continuation positions.
  train  train the draft on those sequences: soft cross-entropy to the target's renormalised
         top-k distribution (= KL up to a constant) plus a little hard CE on the next token.
  vocab  write --out/draft_vocab.json, the draft's vocabulary subset (recipe key
         draft.vocab_subset): the most frequent tokens of the target's own continuations.
  eval   greedy speculative decoding (draft proposes K=4, target verifies; KV caches for both)
         on held-out code and chat prompts: tokens per target call and acceptance by position;
         and the per-call cost of one cached 1-token forward of each model.
  all    the four in order, then write --out.

Run:  python scripts/train_smollm2_draft.py                 # the defaults are what was run
      python scripts/train_smollm2_draft.py --gen-minutes 1 --steps 20 --work /tmp/w --out /tmp/d
Needs torch and transformers (the `dev` extra) and the converted target.

Status (first run, 2026-12-01, 1 CPU thread, 22 min of generation + 42 min of training): a
192-wide 4-layer draft (11.6M parameters, 23 MB fp16) reached only 1.63 tokens per target call
on held-out code and 1.33 on chat at K=4 (acceptance by position on code: 0.38, 0.16, 0.07,
0.03); validation top-1 agreement 0.44 and still rising. Far from the >= 3.0 the real pair
needs: more target-generated data and more steps are the next levers. The weights are not
committed. One file on purpose (~1000 lines): the phases share the data format and are run as
one reproducible tool, like scripts/train_demo_pair.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import time
from pathlib import Path

from stdlib_corpus import stdlib_sources  # scripts/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("code", "chat", "prose")
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


# ---------------------------------------------------------------- prompts
def code_prompts(tok, n: int, seed: int, max_prompt_tokens: int) -> list[dict]:
    """Beginnings of functions from the stdlib: some context lines, the def line, 0-3 body lines."""
    rng = random.Random(seed)
    defs = []
    for rel, path in stdlib_sources(SKIPPED_DIRS):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(lines):
            if re.match(r"\s*(async\s+)?def \w+\(.*\)\s*(->.*)?:\s*$", line):
                defs.append((rel, i, lines))
    rng.shuffle(defs)
    out, seen_files = [], {}
    for rel, i, lines in defs:
        if len(out) >= n:
            break
        if seen_files.get(rel, 0) >= 4:  # spread over many files
            continue
        seen_files[rel] = seen_files.get(rel, 0) + 1
        before = rng.choice([0, 3, 8, 15, 30])
        after = rng.choice([0, 0, 1, 2, 3])
        start = max(0, i - before)
        text = "\n".join(lines[start:i + 1 + after]) + "\n"
        ids = tok(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
        if len(ids) < 8:
            continue
        out.append({"id": f"code:{rel}:{i}", "kind": "code", "ids": ids})
    return out


CHAT_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "machine learning", "inflation",
    "the French Revolution", "DNA", "climate change", "the stock market", "vaccines",
    "the internet", "gravity", "volcanoes", "democracy", "recursion", "blockchain",
    "the Roman Empire", "electric cars", "sleep", "meditation", "the moon landing",
    "compound interest", "plate tectonics", "the immune system", "renewable energy",
    "quantum computing", "the printing press", "coral reefs", "jazz music", "the Olympics",
    "bees", "rainbows", "antibiotics", "the Great Wall of China", "solar panels",
    "hash tables", "sorting algorithms", "the human heart", "earthquakes", "coffee",
]
CHAT_PAIRS = [
    ("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"),
    ("RAM", "a hard drive"), ("TCP", "UDP"), ("a comet", "an asteroid"), ("Git", "GitHub"),
    ("an alligator", "a crocodile"), ("speed", "velocity"), ("a loan", "a grant"),
    ("HTML", "CSS"), ("a stack", "a queue"), ("baking soda", "baking powder"),
    ("a simile", "a metaphor"), ("latitude", "longitude"), ("a process", "a thread"),
]
CHAT_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "computes the factorial of n", "finds the largest element in a list",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "reads a file and counts its lines", "flattens a nested list", "sorts a dictionary by value",
    "computes the average of a list of numbers", "returns the words of a sentence in reverse order",
    "implements binary search", "capitalizes every word in a string", "sums the digits of a number",
]
CHAT_ACTIVITIES = [
    "learning a new language", "saving money", "staying focused while studying", "running a 5k",
    "writing a cover letter", "cooking rice", "keeping houseplants alive", "public speaking",
    "traveling on a budget", "improving sleep", "learning to code", "making new friends",
    "preparing for a job interview", "reducing stress", "taking better photos",
]
CHAT_PHRASES = ["Good morning", "Where is the train station?", "Thank you very much",
                "I would like a cup of tea", "How are you today?", "The weather is nice"]
# Prose: story openings and expository openings cut mid-sentence, as a user would ask a model
# to continue (bench's `prose` set is of this kind; its own prompts are excluded below).
PROSE_PEOPLE = [
    "The old fisherman", "A young teacher", "The village baker", "My grandmother",
    "The night nurse", "A retired soldier", "The new mayor", "Two brothers", "The librarian",
    "A travelling musician", "The ship's captain", "A farmer's daughter", "The detective",
    "A shy student", "The shopkeeper on the corner", "An elderly painter", "The station master",
    "A little girl named Rosa", "The king's gardener", "My neighbour",
]
PROSE_SITUATIONS = [
    "walked into the empty station just before midnight and",
    "had lived in the same house for forty years, so when the letter arrived",
    "found a small wooden box buried under the apple tree, and inside it",
    "was the only person in town who remembered the flood, and every spring",
    "opened the door to find a stranger standing in the rain, who",
    "had never seen the sea before that summer, when",
    "kept a diary for sixty years, and on the last page",
    "woke up to silence: the whole street was covered in snow, and",
    "was counting the money for the third time when",
    "had promised to finish the bridge before winter, but",
]
PROSE_TOPICS = [
    "the printing press", "bread", "the bicycle", "public libraries", "lighthouses", "tea",
    "the railway", "paper money", "maps", "clocks", "glass", "bridges", "the telephone",
    "honey bees", "rivers", "salt", "the violin", "windmills", "chess", "the postal service",
]
PROSE_FRAMES = [
    "The history of {t} begins long before most people think. In fact,",
    "Few inventions changed daily life as much as {t}. Before it,",
    "If you have ever wondered about {t}, you are not alone. Most people",
    "There are many myths about {t}. The most common one is that",
]


def prose_texts(exclude: list[str]) -> list[str]:
    """Template-made prose openings, none starting like a prompt in `exclude`."""
    texts = [f"{who} {what}" for who in PROSE_PEOPLE for what in PROSE_SITUATIONS]
    texts += [f.format(t=t) for t in PROSE_TOPICS for f in PROSE_FRAMES]
    starts = {" ".join(e.split()[:3]).lower() for e in exclude}
    return [t for t in texts if " ".join(t.split()[:3]).lower() not in starts]


def prose_prompts(tok) -> list[dict]:
    bench_set = ROOT / "qpcbuild" / "data" / "prompts" / "prose.jsonl"
    exclude = [json.loads(line)["prompt"] for line in bench_set.read_text().splitlines()
               if line.strip()]
    return [{"id": f"prose:{t}", "kind": "prose", "ids": tok(t, add_special_tokens=False)["input_ids"]}
            for t in prose_texts(exclude)]


def chat_questions() -> list[str]:
    qs = []
    for t in CHAT_TOPICS:
        qs.append(f"Explain {t} in simple terms.")
        qs.append(f"What are three interesting facts about {t}?")
        qs.append(f"Write a short paragraph about {t} for a ten-year-old.")
    for a, b in CHAT_PAIRS:
        qs.append(f"What is the difference between {a} and {b}?")
    for t in CHAT_TASKS:
        qs.append(f"Write a Python function that {t}.")
        qs.append(f"How would you write a function in JavaScript that {t}?")
    for a in CHAT_ACTIVITIES:
        qs.append(f"Give me some tips for {a}.")
        qs.append(f"What are common mistakes people make when {a}?")
    for p in CHAT_PHRASES:
        for lang in ("French", "Spanish", "German"):
            qs.append(f"How do you say '{p}' in {lang}?")
    for x, y in ((12, 7), (45, 3), (100, 25), (9, 8), (123, 4)):
        qs.append(f"What is {x} times {y}? Explain your steps.")
    qs += ["Write a haiku about autumn.", "Tell me a short story about a brave cat.",
           "Write a limerick about a programmer.", "Suggest a name for a coffee shop.",
           "What should I cook for dinner tonight?", "Write an email asking for a day off.",
           "Summarize the plot of Romeo and Juliet.", "What is the capital of Australia?",
           "Who wrote Pride and Prejudice?", "Why is the sky blue?"]
    return qs


def chat_prompts(tok) -> list[dict]:
    out = []
    for q in chat_questions():
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append({"id": f"chat:{q}", "kind": "chat", "ids": ids, "question": q})
    return out


def build_prompts(tok, args) -> list[dict]:
    prompts = code_prompts(tok, args.code_prompts, args.seed, args.max_prompt_tokens)
    prompts += chat_prompts(tok)
    prompts += prose_prompts(tok)
    for p in prompts:
        p["heldout"] = stable_hash(p["id"]) % 100 < args.heldout_percent
    return prompts


# ---------------------------------------------------------------- models
def load_target(path: Path):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------- phase: gen
def generation_jobs(prompts: list[dict], seed: int, sampled_code_share: float) -> list[dict]:
    """One job per (prompt, mode). Code: greedy, or sampled for a share; chat and prose: greedy
    + sampled."""
    rng = random.Random(seed + 1)
    jobs = []
    for p in prompts:
        if p["heldout"]:
            continue
        if p["kind"] == "code":
            jobs.append({**p, "mode": "sample" if rng.random() < sampled_code_share else "greedy"})
        else:
            jobs.append({**p, "mode": "greedy"})
            jobs.append({**p, "mode": "sample"})
    return jobs


def make_batches(jobs: list[dict], batch_size: int, seed: int) -> list[list[dict]]:
    """Same-mode batches of similar prompt length (less padding), in an interleaved order. Prose
    (added after the first runs) comes after code and chat, so their batch numbers are kept."""
    def group(kinds, rng_seed):
        out = []
        for kind in kinds:
            for mode in ("greedy", "sample"):
                g = sorted((j for j in jobs if j["kind"] == kind and j["mode"] == mode),
                           key=lambda j: len(j["ids"]))
                out += [g[i:i + batch_size] for i in range(0, len(g), batch_size)]
        random.Random(rng_seed).shuffle(out)
        return out
    return group(("code", "chat"), seed + 2) + group(("prose",), seed + 3)


def generate_with_teacher(target, batch: list[dict], new_tokens: int, sample: bool,
                          temperature: float, topk: int, pad: int, eos: int, gen):
    """Left-padded batched decoding with a KV cache that also keeps the target's top-k next-token
    log-probs at every position (prompt positions from the prefill, then each decode step), so
    no second teacher-forced pass is needed."""
    import torch
    import torch.nn.functional as F
    width = max(len(j["ids"]) for j in batch)
    n = len(batch)
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, j in enumerate(batch):
        ids[r, width - len(j["ids"]):] = torch.tensor(j["ids"])
        mask[r, width - len(j["ids"]):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    vals, idxs, toks = [], [], []
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                     logits_to_keep=0)
        past = out.past_key_values
        logp = F.log_softmax(out.logits.float(), dim=-1)
        v, i = logp.topk(topk, dim=-1)
        prompt_v, prompt_i = v, i  # [n, width, k]
        last_logp = logp[:, -1]
        del out, logp
        done = torch.zeros(n, dtype=torch.bool)
        next_pos = pos[:, -1:] + 1
        for _ in range(new_tokens):
            if sample:
                probs = F.softmax(last_logp / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                nxt = last_logp.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            toks.append(nxt)
            done |= nxt == eos
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos,
                         past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_pos = next_pos + 1
            last_logp = F.log_softmax(out.logits[:, -1].float(), dim=-1)
            v, i = last_logp.topk(topk, dim=-1)
            vals.append(v)
            idxs.append(i)
    toks = torch.stack(toks, 1)  # [n, T]
    gen_v = torch.stack(vals, 1) if vals else prompt_v[:, :0]
    gen_i = torch.stack(idxs, 1) if idxs else prompt_i[:, :0]
    rows = []
    for r, j in enumerate(batch):
        cont = toks[r].tolist()
        if eos in cont:
            cont = cont[:cont.index(eos) + 1]
        p = len(j["ids"])
        seq = j["ids"] + cont
        # predictions for positions 0..len(seq)-2 (next token of each position but the last)
        v = torch.cat([prompt_v[r, width - p:], gen_v[r]], 0)[:len(seq) - 1]
        i = torch.cat([prompt_i[r, width - p:], gen_i[r]], 0)[:len(seq) - 1]
        rows.append((seq, len(cont), v.half(), i.int()))
    return rows


def phase_gen(args) -> None:
    import torch
    work = args.work / "gen"
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.target)
    prompts = build_prompts(tok, args)
    (args.work / "prompts.json").write_text(json.dumps(prompts))
    n_held = sum(p["heldout"] for p in prompts)
    log(f"{len(prompts)} prompts ({sum(p['kind'] == 'code' for p in prompts)} code, "
        f"{sum(p['kind'] == 'chat' for p in prompts)} chat, "
        f"{sum(p['kind'] == 'prose' for p in prompts)} prose), {n_held} held out")
    jobs = generation_jobs(prompts, args.seed, args.sampled_code_share)
    batches = make_batches(jobs, args.gen_batch, args.seed)
    log(f"{len(jobs)} generation jobs in {len(batches)} batches of <= {args.gen_batch}")
    target = load_target(args.target)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    spent = sum(json.loads(f.read_text())["seconds"] for f in work.glob("batch_*.json"))
    start = time.time()
    for b, batch in enumerate(batches):
        done_file = work / f"batch_{b:04d}.json"
        if done_file.exists() or batch[0]["kind"] not in args.gen_kinds.split(","):
            continue
        if args.gen_max_batches and b >= args.gen_max_batches:
            log(f"--gen-max-batches {args.gen_max_batches} reached")
            break
        if spent + (time.time() - start) > args.gen_minutes * 60:
            log(f"generation budget of {args.gen_minutes} min spent")
            break
        t0 = time.time()
        sample = batch[0]["mode"] == "sample"
        gen = torch.Generator().manual_seed(args.seed * 1000 + b)
        rows = generate_with_teacher(target, batch, args.gen_new_tokens, sample, 0.7, args.topk,
                                     pad, eos, gen)
        torch.save({"seqs": [r[0] for r in rows], "prompt_lens": [len(j["ids"]) for j in batch],
                    "kinds": [j["kind"] for j in batch], "modes": [j["mode"] for j in batch],
                    "ids": [j["id"] for j in batch],
                    "topk_logp": [r[2] for r in rows], "topk_idx": [r[3] for r in rows]},
                   work / f"batch_{b:04d}.pt")
        secs = time.time() - t0
        new = sum(r[1] for r in rows)
        done_file.write_text(json.dumps({"seconds": secs, "new_tokens": new,
                                         "tokens": sum(len(r[0]) for r in rows)}))
        log(f"batch {b} ({batch[0]['kind']}/{batch[0]['mode']}, {len(batch)} x "
            f"<= {max(len(j['ids']) for j in batch)}): {new} new tokens in {secs:.1f} s "
            f"({new / secs:.0f} tok/s); total {(spent + time.time() - start) / 60:.1f} min")


# ---------------------------------------------------------------- phase: train
def draft_config(args, target_cfg: dict):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=target_cfg["vocab_size"], hidden_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.intermediate, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=float(target_cfg.get("rope_theta", 100000.0)),
        tie_word_embeddings=True, bos_token_id=target_cfg.get("bos_token_id"),
        eos_token_id=target_cfg.get("eos_token_id"), pad_token_id=target_cfg.get("pad_token_id"),
        attn_implementation="sdpa")


def svd_embedding(target_path: Path, hidden: int):
    """Target embedding (V x 576) -> V x hidden by truncated SVD: U_h * S_h, i.e. the coordinates
    of every token's embedding on the top `hidden` right-singular directions (uncentered PCA)."""
    import torch
    from safetensors.torch import load_file
    sd = load_file(str(target_path / "model.safetensors"))
    emb = (sd.get("model.embed_tokens.weight") if "model.embed_tokens.weight" in sd
           else sd["lm_head.weight"]).float()
    u, sv, vh = torch.linalg.svd(emb, full_matrices=False)
    kept = float((sv[:hidden] ** 2).sum() / (sv ** 2).sum())
    return (u[:, :hidden] * sv[:hidden]).contiguous(), kept


def load_gen_data(work: Path):
    import torch
    seqs = []
    for f in sorted((work / "gen").glob("batch_*.pt")):
        d = torch.load(f)
        for n in range(len(d["seqs"])):
            seqs.append({"ids": d["seqs"][n], "prompt_len": d["prompt_lens"][n],
                         "kind": d["kinds"][n], "mode": d["modes"][n], "id": d["ids"][n],
                         "v": d["topk_logp"][n], "i": d["topk_idx"][n]})
    return seqs


def split_validation(seqs: list[dict], percent: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): a sequence is held out by a hash of its prompt id and mode."""
    val = [s for s in seqs if stable_hash(s["id"] + s["mode"] + "val") % 100 < percent]
    held = {id(s) for s in val}
    return [s for s in seqs if id(s) not in held], val


def phase_vocab(args) -> None:
    """The draft's vocabulary subset for recipes (draft.vocab_subset): the --vocab-subset most
    frequent tokens of the target's own continuations in the training split."""
    from collections import Counter
    train, val = split_validation(load_gen_data(args.work), args.val_percent)
    if not train:
        raise SystemExit("no generated data; run --phase gen first")
    counts = Counter(t for s in train for t in s["ids"][s["prompt_len"]:])
    keep = sorted(t for t, _ in counts.most_common(args.vocab_subset))
    held = [t for s in val for t in s["ids"][s["prompt_len"]:]]
    kept = set(keep)
    coverage = sum(t in kept for t in held) / max(1, len(held))
    out = args.out / "draft_vocab.json"
    out.write_text(json.dumps({
        "token_ids": keep,
        "chosen_by": f"the {len(keep)} most frequent tokens of the target's continuations in "
                     f"the training split ({sum(counts.values())} tokens, {len(counts)} distinct)",
        "heldout_coverage": round(coverage, 4)}) + "\n")
    log(f"{out}: {len(keep)} tokens; they cover {coverage:.1%} of the {len(held)} held-out "
        "continuation tokens")


def stdlib_stream(tok, heldout_files: set[str]):
    import numpy as np
    ids = []
    for rel, path in stdlib_sources(SKIPPED_DIRS):
        if rel in heldout_files:
            continue
        try:
            ids.extend(tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        except (UnicodeDecodeError, OSError):
            continue
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int64)


def make_batch(rows: list[dict], pad: int, prompt_w: float):
    import torch
    width = max(len(r["ids"]) for r in rows) - 1
    k = rows[0]["v"].shape[1]
    inp = torch.full((len(rows), width), pad, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    tv = torch.full((len(rows), width, k), -1e4)
    ti = torch.zeros((len(rows), width, k), dtype=torch.long)
    w = torch.zeros((len(rows), width))
    for r, row in enumerate(rows):
        n = len(row["ids"]) - 1
        ids = torch.tensor(row["ids"])
        inp[r, :n] = ids[:-1]
        lab[r, :n] = ids[1:]
        tv[r, :n] = row["v"].float()
        ti[r, :n] = row["i"].long()
        w[r, :n] = 1.0
        w[r, :max(0, row["prompt_len"] - 1)] = prompt_w
    return inp, lab, tv, ti, w


class FusedHeadLoss:
    """Tied LM head + loss without materialising [N, 49152] tensors for autograd: chunk by chunk,
    logits -> softmax -> weighted loss, and the gradient w.r.t. the logits in closed form
    (ws + wh) * q - ws * p_teacher - wh * onehot(label), folded straight into dL/dx and dL/dW.
    Loss per row = ws * CE(p_teacher, q) + wh * CE(onehot(label), q); p_teacher is the target's
    renormalised top-k distribution, so the soft term is KL(target || draft) + a constant."""

    @staticmethod
    def apply(x, weight, ti, p, lab, ws, wh, chunk: int = 512):
        import torch

        class _F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight):
                gx = torch.empty_like(x)
                gw = torch.zeros_like(weight)
                loss = x.new_zeros(())
                stats = x.new_zeros(2)  # sum of ws * (soft CE - teacher entropy), top-1 agreement
                for c in range(0, x.shape[0], chunk):
                    xc, tic, pc, lc = x[c:c + chunk], ti[c:c + chunk], p[c:c + chunk], lab[c:c + chunk]
                    wsc, whc = ws[c:c + chunk], wh[c:c + chunk]
                    lg = xc @ weight.t()
                    gt = lg.gather(1, tic)
                    gl = lg.gather(1, lc[:, None]).squeeze(1)
                    stats[1] += ((lg.argmax(1) == tic[:, 0]) & (wsc > 0)).float().sum()
                    m = lg.max(1, keepdim=True).values
                    q = lg.sub_(m).exp_()
                    ssum = q.sum(1, keepdim=True)
                    lse = (m + ssum.log()).squeeze(1)
                    soft = -(pc * (gt - lse[:, None])).sum(1)
                    hard = lse - gl
                    ent = -(pc * pc.clamp_min(1e-12).log()).sum(1)
                    loss += (wsc * soft + whc * hard).sum()
                    stats[0] += (wsc * (soft - ent)).sum()
                    q.div_(ssum).mul_((wsc + whc)[:, None])
                    q.scatter_add_(1, tic, -(wsc[:, None] * pc))
                    q.scatter_add_(1, lc[:, None], -whc[:, None])
                    gx[c:c + chunk] = q @ weight
                    gw.addmm_(q.t(), xc)
                ctx.save_for_backward(gx, gw)
                ctx.stats = stats
                return loss

            @staticmethod
            def backward(ctx, go):
                gx, gw = ctx.saved_tensors
                return go * gx, go * gw

        box = {}

        class _G(_F):
            @staticmethod
            def forward(ctx, x, weight):
                out = _F.forward(ctx, x, weight)
                box["stats"] = ctx.stats
                return out

        loss = _G.apply(x, weight)
        return loss, box["stats"]


def distill_step_loss(draft, inp, lab, tv, ti, w, hard_w: float, extra=None, extra_w=0.0):
    """Loss on one batch (+ optional plain-CE windows); returns loss, KL, top-1 agreement."""
    import torch
    import torch.nn.functional as F
    mask = lab != -100
    hidden = draft.model(input_ids=inp, attention_mask=mask.long()).last_hidden_state
    keep = mask.reshape(-1)
    x = hidden.reshape(-1, hidden.shape[-1])[keep]
    p = F.softmax(tv.reshape(-1, tv.shape[-1])[keep], dim=-1)
    tix = ti.reshape(-1, ti.shape[-1])[keep]
    labs = lab.reshape(-1)[keep]
    wrow = w.reshape(-1)[keep]
    total = wrow.sum()
    ws, wh = wrow / total, hard_w * wrow / total
    n_soft = x.shape[0]
    if extra is not None:
        eh = draft.model(input_ids=extra[:, :-1]).last_hidden_state
        ex = eh.reshape(-1, eh.shape[-1])
        n = ex.shape[0]
        x = torch.cat([x, ex])
        p = torch.cat([p, p.new_zeros((n, p.shape[1]))])
        tix = torch.cat([tix, tix.new_zeros((n, tix.shape[1]))])
        labs = torch.cat([labs, extra[:, 1:].reshape(-1)])
        ws = torch.cat([ws, ws.new_zeros(n)])
        wh = torch.cat([wh, wh.new_full((n,), extra_w / n)])
    loss, stats = FusedHeadLoss.apply(x, draft.model.embed_tokens.weight, tix, p, labs, ws, wh)
    kl = stats[0]  # ws sums to 1 over the soft rows
    agree = stats[1] / max(1, n_soft)
    return loss, kl, agree


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def phase_train(args) -> None:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM
    tok = load_tokenizer(args.target)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    target_cfg = json.loads((args.target / "config.json").read_text())
    seqs = load_gen_data(args.work)
    if not seqs:
        raise SystemExit("no generated data; run --phase gen first")
    train, val = split_validation(seqs, args.val_percent)
    stats = {"sequences": len(seqs), "train_sequences": len(train), "val_sequences": len(val),
             "tokens": sum(len(s["ids"]) for s in seqs),
             "continuation_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in seqs),
             "by_kind": {k: sum(1 for s in seqs if s["kind"] == k) for k in KINDS},
             "by_mode": {m: sum(1 for s in seqs if s["mode"] == m) for m in ("greedy", "sample")}}
    log(f"data: {json.dumps(stats)}")
    prompts = json.loads((args.work / "prompts.json").read_text())
    heldout_files = {p["id"].split(":")[1] for p in prompts if p["heldout"] and p["kind"] == "code"}
    stream = stdlib_stream(tok, heldout_files) if args.stdlib_tokens_per_step else None
    if stream is not None:
        stats["stdlib_stream_tokens"] = int(len(stream))
        log(f"stdlib CE stream: {len(stream):,} tokens (files of held-out prompts excluded)")

    torch.manual_seed(args.seed)
    draft = LlamaForCausalLM(draft_config(args, target_cfg))
    emb, kept = svd_embedding(args.target, args.hidden)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(emb)
    draft.tie_weights()
    stats["svd_energy_kept"] = round(kept, 4)
    log(f"draft: {sum(p.numel() for p in draft.parameters()):,} params; SVD init keeps "
        f"{kept:.1%} of the embedding's energy")
    emb_params = [draft.model.embed_tokens.weight]
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    nodecay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([
        {"params": emb_params, "lr_scale": args.embed_lr_scale, "weight_decay": 0.0},
        {"params": decay, "lr_scale": 1.0, "weight_decay": 0.05},
        {"params": nodecay, "lr_scale": 1.0, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95))
    ckpt = args.work / "ckpt.pt"
    step, history, spent = 0, [], 0.0
    if ckpt.exists():
        state = torch.load(ckpt)
        if state.get("arch") == [args.hidden, args.layers, args.heads, args.kv_heads,
                                 args.intermediate]:
            draft.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step, history, spent = state["step"], state["history"], state["seconds"]
            log(f"resumed from step {step}")

    rng = np.random.default_rng(args.seed + step)
    order: list[int] = []

    def next_rows():
        nonlocal order
        rows, tokens = [], 0
        while tokens < args.batch_tokens:
            if not order:
                perm = rng.permutation(len(train)).tolist()
                # sort chunks of 64 by length so a batch pads little
                order = [i for c in range(0, len(perm), 64)
                         for i in sorted(perm[c:c + 64], key=lambda i: len(train[i]["ids"]))]
                chunks = [order[c:c + 8] for c in range(0, len(order), 8)]
                rng.shuffle(chunks)
                order = [i for c in chunks for i in c]
            r = train[order.pop()]
            rows.append(r)
            tokens += len(r["ids"])
        return rows

    @torch.no_grad()
    def validate():
        draft.eval()
        tot = {"kl": 0.0, "agree": 0.0, "n": 0}
        for c in range(0, len(val), 16):
            inp, lab, tv, ti, w = make_batch(val[c:c + 16], pad, 1.0)
            w = (lab != -100).float()
            for r, row in enumerate(val[c:c + 16]):  # continuation positions only
                w[r, :max(0, row["prompt_len"] - 1)] = 0.0
            lab = lab.masked_fill(w == 0, -100)
            _, kl, agree = distill_step_loss(draft, inp, lab, tv, ti, w, 0.0)
            n = float((w > 0).sum())
            tot["kl"] += kl.item() * n
            tot["agree"] += agree.item() * n
            tot["n"] += n
        draft.train()
        return {"val_kl": round(tot["kl"] / tot["n"], 4),
                "val_top1_agree": round(tot["agree"] / tot["n"], 4)}

    def save_ckpt():
        torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step,
                    "history": history, "seconds": spent, "stats": stats,
                    "arch": [args.hidden, args.layers, args.heads, args.kv_heads,
                             args.intermediate]}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").replace(ckpt)

    if step == 0:
        row = {"step": 0, **validate(), "elapsed_s": 0.0}
        history.append(row)
        log(json.dumps(row))
    draft.train()
    t_start = time.time() - spent
    while step < args.steps:
        if time.time() - t_start > args.train_minutes * 60:
            log(f"training time budget of {args.train_minutes} min reached at step {step}")
            break
        if args.stop_at_step and step >= args.stop_at_step:
            log(f"--stop-at-step {args.stop_at_step} reached")
            break
        scale = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = args.lr * scale * g["lr_scale"]
        inp, lab, tv, ti, w = make_batch(next_rows(), pad, args.prompt_loss_weight)
        chunk = None
        if stream is not None:
            n_win = max(1, args.stdlib_tokens_per_step // 256)
            offs = rng.integers(0, len(stream) - 257, size=n_win)
            chunk = torch.from_numpy(np.stack([stream[o:o + 257] for o in offs]))
        loss, kl, agree = distill_step_loss(draft, inp, lab, tv, ti, w, args.hard_ce_weight,
                                            chunk, args.stdlib_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        spent = time.time() - t_start
        if step % 25 == 0 or step == 1:
            row = {"step": step, "loss": round(loss.item(), 4), "kl": round(kl.item(), 4),
                   "top1_agree": round(agree.item(), 4),
                   "lr": round(args.lr * scale, 6), "elapsed_s": round(spent, 1)}
            if step % args.checkpoint_every == 0:
                row.update(validate())
            history.append(row)
            log(json.dumps(row))
        if step % args.checkpoint_every == 0:
            save_ckpt()
            write_draft(args, draft, stats, history, step, spent, partial=True)
    if not history or "val_kl" not in history[-1]:
        row = {"step": step, **validate(), "elapsed_s": round(spent, 1)}
        history.append(row)
        log(json.dumps(row))
    save_ckpt()
    write_draft(args, draft, stats, history, step, spent, partial=False)


def write_draft(args, draft, stats, history, step, seconds, partial: bool) -> None:
    """Write the float16 draft + tokenizer files + training.json into --out (atomically)."""
    import copy
    out = args.out
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    half = copy.deepcopy(draft).half()
    # Shards of < 20 MiB each (the embedding alone, then the rest), so no committed file is big.
    half.save_pretrained(tmp, safe_serialization=True, max_shard_size="15MB")
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["rope_theta"] = float((cfg.get("rope_parameters") or {}).get("rope_theta", 100000.0))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (args.target / name).exists():
            shutil.copy2(args.target / name, tmp / name)
    info = {"partial": partial, "step": step, "train_seconds": round(seconds, 1),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "data": stats, "params": sum(p.numel() for p in draft.parameters()),
            "history": history,
            "machine": f"{os.cpu_count()} CPU cores, {args.threads} torch thread(s), "
                       f"torch {__import__('torch').__version__}, python {platform.python_version()}"}
    old = out / "training.json"
    if old.exists():  # keep eval results of an earlier eval phase only if they match this step
        prev = json.loads(old.read_text())
        if prev.get("step") == step and "eval" in prev:
            info["eval"] = prev["eval"]
    (tmp / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out.exists():
        keep = out / "README.md"
        if keep.exists():
            shutil.copy2(keep, tmp / "README.md")
        shutil.rmtree(out)
    tmp.rename(out)


# ---------------------------------------------------------------- phase: eval
def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions (crop(-n) removes n; works on transformers 4 and 5)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def spd_greedy(target, draft, prompt: list[int], k: int, new_tokens: int, eos: int):
    """Greedy speculative decoding with KV caches (crop on rejection). Each target call verifies
    the K draft tokens and always yields one token of its own; returns the new tokens, the number
    of verification calls (prefill not counted) and accepted counts by position."""
    import torch
    from transformers import DynamicCache
    t_cache, d_cache = DynamicCache(), DynamicCache()
    seq = list(prompt)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([seq]), cache=t_cache, use_cache=True,
                     logits_to_keep=1)
        seq.append(int(out.logits[0, -1].argmax()))  # the prefill's own token (not counted)
        calls, acc = 0, [0] * k
        while len(seq) - len(prompt) < new_tokens and seq[-1] != eos:
            proposal = []
            for _ in range(k):
                feed = (seq + proposal)[d_cache.get_seq_length():]
                o = draft(input_ids=torch.tensor([feed]), cache=d_cache, use_cache=True,
                          logits_to_keep=1)
                proposal.append(int(o.logits[0, -1].argmax()))
            base = t_cache.get_seq_length()
            feed = seq[base:] + proposal
            o = target(input_ids=torch.tensor([feed]), cache=t_cache, use_cache=True)
            verdict = o.logits[0, -(k + 1):].argmax(-1).tolist()
            calls += 1
            n = 0
            while n < k and proposal[n] == verdict[n]:
                acc[n] += 1
                n += 1
            seq += proposal[:n] + [verdict[n]]
            crop_to(t_cache, len(seq) - 1)
            crop_to(d_cache, len(seq) - 1)
    new = seq[len(prompt):]
    if eos in new:
        new = new[:new.index(eos) + 1]
    return new[:new_tokens], calls, acc


def target_greedy(target, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    import torch
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def per_call_cost(model, ctx: list[int], reps: int = 40) -> float:
    """Median seconds of one cached forward of 1 token (batch 1) after a prefill of ctx."""
    import statistics
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    times = []
    with torch.no_grad():
        model(input_ids=torch.tensor([ctx]), cache=cache, use_cache=True, logits_to_keep=1)
        n = cache.get_seq_length()
        for r in range(reps + 5):
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([[ctx[r % len(ctx)]]]), cache=cache, use_cache=True)
            dt = time.perf_counter() - t0
            crop_to(cache, n)
            if r >= 5:  # warmup
                times.append(dt)
    return statistics.median(times)


def phase_eval(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(args.target)
    eos = tok.eos_token_id
    target = load_target(args.target)
    # evaluate what is shipped: the float16 weights, computed in float32 on CPU
    draft = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    prompts = [p for p in json.loads((args.work / "prompts.json").read_text()) if p["heldout"]]
    results = {}
    for kind in KINDS:
        chosen = [p for p in prompts if p["kind"] == kind][:args.eval_prompts]
        tokens, calls, acc, lossless, t0 = 0, 0, [0] * args.eval_k, 0, time.time()
        for n, p in enumerate(chosen):
            new, c, a = spd_greedy(target, draft, p["ids"], args.eval_k, args.eval_new_tokens, eos)
            if n < args.lossless_checks:
                lossless += new == target_greedy(target, p["ids"], len(new), eos)[:len(new)]
            tokens += len(new) - 1  # the prefill's token is not a verification call's
            calls += c
            acc = [x + y for x, y in zip(acc, a)]
        results[kind] = {
            "prompts": len(chosen), "k": args.eval_k, "max_new_tokens": args.eval_new_tokens,
            "new_tokens": tokens, "target_calls": calls,
            "tokens_per_target_call": round(tokens / max(1, calls), 3),
            "acceptance_by_position": [round(x / max(1, calls), 3) for x in acc],
            "conditional_acceptance": [round(acc[i] / max(1, (acc[i - 1] if i else calls)), 3)
                                       for i in range(args.eval_k)],
            "lossless_vs_target_greedy": f"{lossless}/{min(args.lossless_checks, len(chosen))}",
            "seconds": round(time.time() - t0, 1)}
        log(f"eval {kind}: {json.dumps(results[kind])}")
    ctx = prompts[0]["ids"][:64]
    t_cost = per_call_cost(target, ctx)
    d_cost = per_call_cost(draft, ctx)
    results["per_call_cost"] = {
        "what": "median wall time of one 1-token forward with a KV cache of 64 tokens, batch 1, "
                f"float32, {args.threads} torch thread(s), transformers eager/sdpa, after warmup",
        "target_ms": round(t_cost * 1e3, 2), "draft_ms": round(d_cost * 1e3, 2),
        "draft_over_target": round(d_cost / t_cost, 4)}
    log(f"per-call cost: {json.dumps(results['per_call_cost'])}")
    path = args.out / "training.json"
    info = json.loads(path.read_text())
    info["eval"] = results
    path.write_text(json.dumps(info, indent=1) + "\n")
    log(f"eval written to {path}")


# ---------------------------------------------------------------- model card
TRIED = """\
- One architecture was trained (the one above); the CPU budget (2 shared cores, 1 torch
  thread, under ~2 hours for everything) allowed no second full run, so sizes were compared on
  paper only: the tied 49152-row head costs hidden x 49152 MACs per token (9.4M at hidden 192,
  6.3M at 128) against ~0.5M per layer here, so depth is cheap and width is not; hidden 192 x
  4 layers is about the largest shape under the 25 MB float16 limit (hidden 256 would need
  25.2 MB for the embedding alone).
- Loss implementation: the first version (autograd `log_softmax` over [~5000, 49152] plus a
  transposed `cross_entropy`) took ~50 s per step while the generation job shared the CPU; the
  fused chunked loss in the script (closed-form gradient w.r.t. the logits, checked against
  autograd in float64) runs a step of ~4096 + 1024 tokens in ~8.5 s.
- Generation: transformers' `generate` plus a separate teacher-forced pass for the top-k
  targets was replaced by one cached decoding loop that records the target's top-k log-probs
  while it decodes (same tokens as `generate` on the prompts checked; no second pass). It ran
  at 40-90 generated tokens/s (batch 32, 1 thread, CPU shared with other jobs).
- Result versus the goal: tau >= 3.0 at K=4 was the aim; this draft reaches far less (see
  above). Train-set top-1 agreement (0.55) was still rising at the end and is above the
  held-out one (0.44), so both more target-generated data and more steps are needed; with
  ~85k generated tokens and 300 steps on one CPU thread this is what was reached.
- Per-call cost: the draft's cached 1-token call measured 0.10-0.15 of the target's in
  repeated runs on this shared CPU (parameter ratio 0.086): the 49152-row head is most of the
  draft's work and fixed per-call overhead of eager transformers adds the rest.
- Generation is time-budgeted (--gen-minutes); this run finished 22 batches (697 sequences).
  To regenerate exactly that data on another machine use --gen-minutes 1000 --gen-max-batches 22.
"""


def write_card(args) -> None:
    info = json.loads((args.out / "training.json").read_text())
    cfg = json.loads((args.out / "config.json").read_text())
    size_mb = sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 1e6
    d, st = info["data"], info["settings"]
    last_val = next((h for h in reversed(info["history"]) if "val_kl" in h), {})
    first_val = info["history"][0] if info["history"] else {}
    lines = [
        "# SmolLM2-135M-Instruct draft (qpcbuild)",
        "",
        "A small draft model for speculative decoding with `models/smollm2-135m-instruct`",
        "(a dequantized Q4_1 copy of HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0), trained on",
        "CPU by `scripts/train_smollm2_draft.py`. Same tokenizer files as the target (byte-identical",
        f"`tokenizer.json`), vocab {cfg['vocab_size']}.",
        "",
        "## Model",
        f"- LlamaForCausalLM: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads "
        f"(head_dim {cfg.get('head_dim', cfg['hidden_size'] // cfg['num_attention_heads'])}), "
        f"MLP {cfg['intermediate_size']}, tied embeddings, rope theta {cfg['rope_theta']:g}.",
        f"- {info['params']:,} parameters ({cfg['vocab_size'] * cfg['hidden_size']:,} of them the "
        f"tied embedding / LM head); float16 safetensors, {size_mb:.1f} MB.",
        f"- Embedding initialised from the target's (49152 x 576) by truncated SVD to "
        f"{cfg['hidden_size']} dims (U_h S_h, uncentered PCA; keeps "
        f"{d.get('svd_energy_kept', float('nan')):.1%} of its energy). Layers random (seed "
        f"{st['seed']}).",
        "",
        "## Data (on-policy distillation)",
        f"- Prompts: beginnings of functions from the Python {platform.python_version()} standard "
        "library (0-30 context lines, the `def` line, 0-3 body lines; at most "
        f"{st['max_prompt_tokens']} tokens), template-made chat questions wrapped in the "
        "target's chat template, and template-made prose openings (stories and expository "
        "text cut mid-sentence, none starting like a prompt of bench's prose set); "
        f"{st['heldout_percent']}% of the prompts held out by hash for evaluation.",
        f"- Generation jobs: each training code prompt once, greedy or (for "
        f"{st['sampled_code_share']:.0%} of them) sampled at temperature 0.7; each chat and "
        "prose prompt twice, greedy and sampled; in shuffled same-mode batches of 32. The target "
        f"continued for up to {st['gen_new_tokens']} tokens (or EOS); generation is "
        "time-budgeted (--gen-minutes), and the batches that ran gave "
        f"{d['sequences']} sequences ({d['by_kind']}, {d['by_mode']}), {d['tokens']:,} tokens, "
        f"{d['continuation_tokens']:,} of them generated. The target's top-{st['topk']} "
        "next-token log-probs were recorded at every position.",
        f"- Plus {st['stdlib_tokens_per_step']} tokens per step of plain next-token CE on stdlib "
        f"source (weight {st['stdlib_weight']}; files of held-out prompts excluded).",
        "",
        "## Training",
        f"- Loss: soft CE to the target's renormalised top-{st['topk']} distribution (= KL + const) "
        f"+ {st['hard_ce_weight']} x hard CE on the next token; prompt positions weigh "
        f"{st['prompt_loss_weight']}.",
        f"- {info['step']} steps of ~{st['batch_tokens']} tokens, AdamW (betas 0.9/0.95), peak lr "
        f"{st['lr']} (embedding x{st['embed_lr_scale']}), warmup {st['warmup']}, cosine to 10%; "
        f"{info['train_seconds'] / 60:.1f} min on {info['machine']}."
        + (" PARTIAL: stopped before the planned steps." if info.get("partial") else ""),
        f"- Validation ({d['val_sequences']} generated sequences kept aside, continuation "
        f"positions): KL(target||draft) over the top-k {first_val.get('val_kl')} -> "
        f"{last_val.get('val_kl')}, top-1 agreement with the target "
        f"{first_val.get('val_top1_agree')} -> {last_val.get('val_top1_agree')}.",
    ]
    vocab = args.out / "draft_vocab.json"
    if vocab.is_file():
        v = json.loads(vocab.read_text())
        lines += ["", "## Vocabulary subset (`draft_vocab.json`)",
                  f"- {len(v['token_ids'])} token ids for a recipe's `draft.vocab_subset`: "
                  f"{v['chosen_by']} (`--phase vocab`). They cover {v['heldout_coverage']:.1%} "
                  "of the held-out continuations' tokens; with the subset the draft's LM head "
                  "reads those rows only and never proposes another token."]
    ev = info.get("eval")
    if ev:
        lines += ["", "## Measured (held-out prompts, greedy speculative decoding)"]
        for kind in (k for k in KINDS if k in ev):
            e = ev[kind]
            lines.append(
                f"- {kind}: {e['prompts']} prompts, K={e['k']}, up to {e['max_new_tokens']} new "
                f"tokens: **{e['tokens_per_target_call']} tokens per target call**; acceptance by "
                f"position {e['acceptance_by_position']} (conditional "
                f"{e['conditional_acceptance']}); output equal to target-only greedy on "
                f"{e['lossless_vs_target_greedy']} checked prompts.")
        c = ev["per_call_cost"]
        lines.append(f"- Per-call cost ({c['what']}): target {c['target_ms']} ms, draft "
                     f"{c['draft_ms']} ms, ratio {c['draft_over_target']}.")
        lines.append("- tokens per target call = generated tokens / verification calls (the "
                     "prefill is not counted); the SpD loop is transformers-only with KV caches.")
    lines += ["", "## What was tried", TRIED,
              "Reproduce: `python scripts/get_smollm2.py && python scripts/train_smollm2_draft.py`",
              "(defaults = this run; `training.json` has every setting and the loss history).", ""]
    (args.out / "README.md").write_text("\n".join(lines))
    log(f"wrote {args.out / 'README.md'}")


# ---------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--phase", choices=("all", "gen", "train", "vocab", "eval", "card"),
                    default="all")
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-draft")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qpcbuild-smollm2-draft"),
                    help="generated data and checkpoints (a cache; safe to delete)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    # data
    ap.add_argument("--code-prompts", type=int, default=1400)
    ap.add_argument("--heldout-percent", type=int, default=10)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--sampled-code-share", type=float, default=0.3)
    ap.add_argument("--gen-minutes", type=float, default=22.0)
    ap.add_argument("--gen-max-batches", type=int, default=0,
                    help="stop generating after this many batches (0: only the time budget)")
    ap.add_argument("--gen-kinds", default=",".join(KINDS),
                    help="generate only the batches of these prompt kinds (comma-separated)")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--vocab-subset", type=int, default=8192,
                    help="tokens in the draft's vocabulary subset (phase vocab)")
    # draft
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--embed-lr-scale", type=float, default=0.3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--hard-ce-weight", type=float, default=0.2)
    ap.add_argument("--prompt-loss-weight", type=float, default=0.5,
                    help="loss weight of positions inside the prompt (continuations weigh 1)")
    ap.add_argument("--val-percent", type=int, default=4,
                    help="generated sequences kept aside for validation loss")
    ap.add_argument("--stdlib-tokens-per-step", type=int, default=1024,
                    help="extra plain next-token CE on stdlib windows (0 disables)")
    ap.add_argument("--stdlib-weight", type=float, default=0.3)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--train-minutes", type=float, default=45.0,
                    help="stop training early (and still save) after this long")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="stop (and save) at this step, keeping the schedule of --steps")
    # eval
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=40, help="per kind (code, chat, prose)")
    ap.add_argument("--lossless-checks", type=int, default=5,
                    help="prompts per kind whose SpD output is compared with target greedy")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if not (args.target / "config.json").is_file():
        print(f"error: {args.target} has no config.json; run scripts/get_smollm2.py first",
              file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase in ("all", "gen"):
        phase_gen(args)
    if args.phase in ("all", "train"):
        phase_train(args)
    if args.phase in ("all", "vocab"):
        phase_vocab(args)
    if args.phase in ("all", "eval"):
        phase_eval(args)
    if args.phase in ("all", "eval", "card"):
        write_card(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
