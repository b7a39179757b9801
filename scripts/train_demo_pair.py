#!/usr/bin/env python3
"""Train the demo pair: a small code model and a much smaller drafter for it, on CPython's own
standard-library sources, with a byte-level BPE tokenizer trained on the same files.

    python3 scripts/train_demo_pair.py --out src/draftrelay/demo_pair          # on a GPU: a few minutes
    python3 scripts/train_demo_pair.py --out /tmp/pair --time-budget-s 60 --max-corpus-mb 2   # a CPU try

What it writes (the HF-directory layout the project's loader reads, weights in bf16):
    OUT/target/{config.json, model.safetensors, tokenizer.json}
    OUT/drafter/{...}                 the first --drafter shape; further shapes go to OUT/drafter-<n>/
    OUT/TRAINING.json                 corpus, shapes, steps, losses and the estimated acceptance

Both models are the project's own Llama-family `Transformer` (draftrelay.model), so the engine and the
worker serve them unchanged. The target learns next-token prediction on the corpus; every drafter
learns the target's distribution (distillation: KL from the target's softmax, plus a little of the
plain next-token loss) during the same steps, then on its own against the best target checkpoint.
What speculation needs is the drafter agreeing with the target, not the drafter being good on its own.

The corpus is the `.py` files of the running Python's `Lib/` (the directory holding `os.py`, without
site-packages), so it differs a little between Python versions; TRAINING.json records which one.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from draftrelay import model as M  # noqa: E402  (the repo's own source tree first)
from draftrelay.checkpoint.hf import load_hf_dir, save_hf_dir  # noqa: E402
from draftrelay.engine.cli_demo import DEFAULT_PROMPTS as DEMO_PROMPTS  # noqa: E402  (acceptance is estimated on them)

EOS = "<|endoftext|>"
SHAPE_KEYS = ("layers", "hidden", "heads", "kv", "ffn")


# ----------------------------------------------------------------------------------------------
# corpus and tokenizer


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def corpus_files(root: str, max_bytes: int) -> list[str]:
    """The .py files under root (site-packages excluded), sorted, that decode as UTF-8; at most
    max_bytes of them (0: all)."""
    out, total = [], 0
    for fn in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in fn or "dist-packages" in fn or not os.path.isfile(fn):
            continue
        try:
            with open(fn, encoding="utf-8") as f:
                n = len(f.read())
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately in other encodings
        if max_bytes and total + n > max_bytes:
            break
        out.append(fn)
        total += n
    if not out:
        raise SystemExit(f"train_demo_pair: no readable .py files under {root}")
    return out


def read_texts(files: list[str]) -> list[str]:
    texts = []
    for fn in files:
        with open(fn, encoding="utf-8") as f:
            texts.append(f.read())
    return texts


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE (GPT-2's pre-tokenizer, no prefix space): every text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_corpus(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# models


def parse_shape(s: str) -> dict[str, int]:
    """'layers=24,hidden=160,heads=4,kv=2,ffn=384' (kv defaults to heads, ffn to 3 * hidden)."""
    vals: dict[str, int] = {}
    for part in s.split(","):
        key, sep, v = part.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS or not v.strip().isdigit() or int(v) <= 0:
            raise argparse.ArgumentTypeError(f"shape {s!r}: expected comma-separated key=positive-int with keys "
                                             f"{', '.join(SHAPE_KEYS)}; bad part {part!r}")
        vals[key] = int(v)
    for need in ("layers", "hidden", "heads"):
        if need not in vals:
            raise argparse.ArgumentTypeError(f"shape {s!r}: missing '{need}'")
    vals.setdefault("kv", vals["heads"])
    vals.setdefault("ffn", 3 * vals["hidden"])
    if vals["hidden"] % vals["heads"] or vals["heads"] % vals["kv"] or (vals["hidden"] // vals["heads"]) % 2:
        raise argparse.ArgumentTypeError(f"shape {s!r}: hidden must split into heads of even size, "
                                         "and heads must be a multiple of kv")
    return vals


def make_config(shape: dict[str, int], vocab: int, max_pos: int, name: str) -> M.ModelConfig:
    return M.ModelConfig(vocab_size=vocab, hidden_size=shape["hidden"], n_layers=shape["layers"],
                         n_heads=shape["heads"], n_kv_heads=shape["kv"], head_dim=shape["hidden"] // shape["heads"],
                         intermediate_size=shape["ffn"], rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=max_pos, name=name)


def new_model(cfg: M.ModelConfig, seed: int, device: torch.device) -> M.Transformer:
    """GPT-2-style init: N(0, 0.02), the projections that write into the residual stream scaled by
    1/sqrt(2 * layers) so a deep stack starts close to the identity."""
    torch.manual_seed(seed)
    net = M.Transformer(cfg)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * cfg.n_layers))
            else:
                p.normal_(0.0, 0.02)
    return net.to(device).train()


def train_logits(net: M.Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Causal logits [B,T,V] of whole sequences with no KV cache, differentiable: the same arithmetic
    as Transformer.forward (RoPE in HF's rotate-half layout, GQA by kv-head groups, tied head), with
    SDPA's causal kernel for the attention. `check_forward_matches` proves the two agree."""
    cfg = net.cfg
    B, T = tokens.shape
    dev = tokens.device
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ang = torch.arange(T, device=dev).float()[:, None] * M.rope_inv_freq(cfg).to(dev)
    cos = torch.cat((ang, ang), dim=-1).cos()[None, :, None, :]
    sin = torch.cat((-ang.sin(), ang.sin()), dim=-1)[None, :, None, :]
    x = net.embed_tokens(tokens)
    for layer in net.layers:
        a = layer.self_attn
        qkv = a.qkv(layer.input_layernorm(x))
        qk = M.apply_rope(qkv[..., :a.nq + a.nk].view(B, T, H + KV, hd), cos, sin).to(qkv.dtype)
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = qkv[..., a.nq + a.nk:].view(B, T, KV, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
        x = x + a.o_proj(att.transpose(1, 2).reshape(B, T, H * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = net.norm(x)
    w = net.embed_tokens.weight if net.lm_head is None else net.lm_head.weight
    return F.linear(x, w)


@torch.no_grad()
def check_forward_matches(net: M.Transformer, vocab: int, seed: int = 0) -> float:
    """Max |logit difference| between train_logits and the engine's cached Transformer.forward (fp32,
    CPU) on a random sequence fed as a prefill chunk and then token by token."""
    ref = copy.deepcopy(net).float().cpu().eval()
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (1, 24), generator=g)
    full = train_logits(ref, toks)
    cache = ref.new_cache(1, 32)
    rows = torch.zeros(1, dtype=torch.long)
    first = ref(toks[:, :16], torch.tensor([0]), cache, rows)
    steps = [ref(toks[:, i:i + 1], torch.tensor([i]), cache, rows) for i in range(16, 24)]
    cached = torch.cat([first, *steps], dim=1)
    return float((full - cached).abs().max())


# ----------------------------------------------------------------------------------------------
# training


class Batches:
    def __init__(self, ids: torch.Tensor, seq: int, device: torch.device, seed: int):
        if len(ids) < seq + 2:
            raise SystemExit(f"train_demo_pair: the corpus has {len(ids)} tokens, fewer than --seq {seq} + 2")
        self.ids = ids.to(device)
        self.seq = seq
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        self.offs = torch.arange(seq + 1, device=device)

    def get(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.ids) - self.seq - 1, (batch,), generator=self.g).to(self.ids.device)
        w = self.ids[starts[:, None] + self.offs].long()
        return w[:, :-1], w[:, 1:]


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of training, then cosine down to floor * peak."""
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, ce_weight: float) -> torch.Tensor:
    """KL(teacher || student) per token, plus ce_weight x the student's own next-token loss."""
    s = F.log_softmax(student.float(), dim=-1).flatten(0, 1)
    t = F.log_softmax(teacher.float(), dim=-1).flatten(0, 1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
    return kl + ce_weight * F.nll_loss(s, y.flatten()) if ce_weight else kl


@torch.no_grad()
def evaluate(target, drafters, val: Batches, n_batches: int, batch: int, autocast) -> dict:
    """Validation loss of each model and the drafters' top-1 agreement with the target."""
    target.eval()
    for d in drafters:
        d.eval()
    g_state = val.g.get_state()
    val.g.manual_seed(1234)  # the same windows every time
    t_loss, d_loss, agree = 0.0, [0.0] * len(drafters), [0.0] * len(drafters)
    for _ in range(n_batches):
        x, y = val.get(batch)
        with autocast():
            tl = train_logits(target, x).float()
            t_loss += float(F.cross_entropy(tl.flatten(0, 1), y.flatten()))
            ta = tl.argmax(-1)
            for i, d in enumerate(drafters):
                dl = train_logits(d, x).float()
                d_loss[i] += float(F.cross_entropy(dl.flatten(0, 1), y.flatten()))
                agree[i] += float((dl.argmax(-1) == ta).float().mean())
    val.g.set_state(g_state)
    target.train()
    for d in drafters:
        d.train()
    n = n_batches
    return {"target_val_loss": t_loss / n, "drafter_val_loss": [v / n for v in d_loss],
            "drafter_top1_agreement": [v / n for v in agree]}


@torch.no_grad()
def greedy(net: M.Transformer, prompt: list[int], n_tokens: int) -> torch.Tensor:
    """prompt + n_tokens greedy tokens [1, len], decoded with the engine's own cached forward."""
    dev = next(net.parameters()).device
    cache = net.new_cache(1, len(prompt) + n_tokens + 1)
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    seq = torch.tensor([prompt], device=dev)
    logits = net(seq, torch.zeros(1, dtype=torch.long), cache, rows, last_only=True)
    for _ in range(n_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = net(nxt, torch.tensor([seq.shape[1]]), cache, rows)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


@torch.no_grad()
def estimate_acceptance(target, drafter, tok, prompts: list[str], n_tokens: int, k: int) -> dict:
    """Greedy acceptance at draft depth k along the target's own greedy continuation of each prompt:
    the drafter's argmax given the true prefix at every position, replayed as rounds of k drafts."""
    target.eval()
    drafter.eval()
    by_pos = [0] * k
    rounds = accepted = 0
    for p in prompts:
        seq = greedy(target, tok.encode(p).ids, n_tokens)
        n0 = seq.shape[1] - n_tokens
        guess = train_logits(drafter, seq[:, :-1]).float().argmax(-1)[0]  # guess[i]: token i + 1
        hit = (guess == seq[0, 1:]).tolist()[n0 - 1:]
        i = 0
        while i < len(hit):
            a = 0
            while a < k and i + a < len(hit) and hit[i + a]:
                by_pos[a] += 1
                a += 1
            rounds += 1
            accepted += a
            i += a + 1
    target.train()
    drafter.train()
    return {"k": k, "rounds": rounds, "mean_accepted": accepted / max(1, rounds),
            "accept_rate_by_pos": [b / max(1, rounds) for b in by_pos]}


def save_pair_member(net: M.Transformer, path: str, tokenizer_json: str, eos_id: int) -> int:
    """bf16 weights in the HF layout; returns the weight file's size."""
    store = copy.deepcopy(net).to(device="cpu", dtype=torch.bfloat16).eval()
    save_hf_dir(store, path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "eos_token_id": eos_id,
                "bos_token_id": eos_id, "_name_or_path": "draftrelay-demo-" + os.path.basename(os.path.abspath(path))})
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


@torch.no_grad()
def greedy_batch(net: M.Transformer, prompts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[B, P] prompts (equal lengths) -> [B, P + n_tokens], greedy, with the engine's cached forward."""
    B, P = prompts.shape
    cache = net.new_cache(B, P + n_tokens + 1)
    rows = torch.arange(B)
    logits = net(prompts, torch.zeros(B, dtype=torch.long), cache, rows, last_only=True)
    seq = prompts
    for _ in range(n_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = net(nxt, torch.full((B,), seq.shape[1], dtype=torch.long), cache, rows)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def refine(args, log) -> int:
    """On-policy distillation of one trained drafter: the target continues random corpus windows
    greedily (what the demo asks of it), the drafter learns the target's distribution along those
    continuations, and most of all its argmax (greedy acceptance is argmax agreement). Runs on a CPU."""
    src = args.refine
    target = load_hf_dir(os.path.join(src, "target"), dtype=torch.float32).eval()
    drafter = load_hf_dir(os.path.join(src, args.refine_drafter), dtype=torch.float32).train()
    from tokenizers import Tokenizer

    with open(os.path.join(src, "target", "tokenizer.json")) as f:
        tok_json = f.read()
    tok = Tokenizer.from_str(tok_json)
    eos_id = tok.token_to_id(EOS)
    files = corpus_files(args.corpus, int(args.max_corpus_mb * 1e6))
    ids = encode_corpus(tok, read_texts(files), eos_id)
    before = estimate_acceptance(target, drafter, tok, DEMO_PROMPTS, 64, 4)
    log(f"refine {src}/{args.refine_drafter}: {len(ids) / 1e6:.2f}M corpus tokens; acceptance before "
        f"{before['mean_accepted']:.2f} drafts per round (k=4)")
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.refine_lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    t_start = time.perf_counter()
    rounds = steps = 0
    P, N = args.refine_prompt, args.refine_tokens
    while time.perf_counter() - t_start < args.time_budget_s:
        starts = torch.randint(0, len(ids) - P - 1, (args.batch,), generator=g)
        prompts = ids[starts[:, None] + torch.arange(P)].long()
        seq = greedy_batch(target, prompts, N)
        with torch.no_grad():
            teacher = train_logits(target, seq[:, :-1])[:, P - 1:]
        y = seq[:, P:]
        for _ in range(args.refine_reuse):  # a generated batch is costly (the target's decode): learn it twice
            progress = (time.perf_counter() - t_start) / args.time_budget_s
            for gr in opt.param_groups:
                gr["lr"] = args.refine_lr * (1 - 0.9 * min(1.0, progress))
            loss = kd_loss(train_logits(drafter, seq[:, :-1])[:, P - 1:], teacher, y, 1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            steps += 1
        rounds += 1
        if rounds % 10 == 0:
            log(f"refine batch {rounds}: loss {float(loss.detach()):.3f}, "
                f"{rounds * args.batch * N / 1e3:.0f}K on-policy tokens")
    after = estimate_acceptance(target, drafter, tok, DEMO_PROMPTS, 64, 4)
    log(f"acceptance after {rounds} generated batches ({steps} steps): {after['mean_accepted']:.2f} drafts per round, "
        f"by position {' '.join(f'{v:.2f}' for v in after['accept_rate_by_pos'])}")
    os.makedirs(args.out, exist_ok=True)
    if os.path.abspath(args.out) != os.path.abspath(src):
        save_pair_member(target, os.path.join(args.out, "target"), tok_json, eos_id)
    save_pair_member(drafter, os.path.join(args.out, "drafter"), tok_json, eos_id)
    info_path = os.path.join(src, "TRAINING.json")
    info = json.load(open(info_path)) if os.path.isfile(info_path) else {}
    info.setdefault("refine", []).append({"drafter": args.refine_drafter, "device": "cpu", "torch": torch.__version__,
                      "python": sys.version.split()[0], "seconds": args.time_budget_s, "generated_batches": rounds,
                      "steps": steps, "batch": args.batch, "prompt_tokens": P, "generated_tokens": N,
                      "lr": args.refine_lr, "acceptance_before": before, "acceptance_after": after})
    info["estimated_acceptance_shipped"] = after
    with open(os.path.join(args.out, "TRAINING.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (target/, drafter/, TRAINING.json)")
    ap.add_argument("--corpus", default=stdlib_dir(), help="directory of .py files (default: this Python's Lib)")
    ap.add_argument("--max-corpus-mb", type=float, default=0.0, help="use at most this many MB of it (0: all)")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    ap.add_argument("--target", type=parse_shape, default=parse_shape("layers=24,hidden=160,heads=4,kv=2,ffn=384"),
                    help=f"target shape, key=value list of {', '.join(SHAPE_KEYS)}")
    ap.add_argument("--drafter", type=parse_shape, action="append", default=None,
                    help="drafter shape (repeatable; default layers=1,hidden=128,heads=2,kv=2,ffn=384)")
    ap.add_argument("--seq", type=int, default=512, help="training window in tokens")
    ap.add_argument("--batch", type=int, default=64, help="windows per step")
    ap.add_argument("--steps", type=int, default=100000, help="upper bound on joint steps (time usually stops first)")
    ap.add_argument("--time-budget-s", type=float, default=240.0, help="wall time for all training")
    ap.add_argument("--drafter-share", type=float, default=0.2,
                    help="share of the time budget for the drafter-only phase against the best target")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (target)")
    ap.add_argument("--drafter-lr", type=float, default=3e-3, help="peak learning rate (drafters)")
    ap.add_argument("--kd-ce", type=float, default=0.1, help="weight of the drafter's own next-token loss")
    ap.add_argument("--eval-every-s", type=float, default=20.0, help="validation interval")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refine", default="", metavar="DIR",
                    help="instead of training: on-policy distillation of DIR/<--refine-drafter> against DIR/target "
                         "for --time-budget-s, written to OUT/drafter (OUT/target copied)")
    ap.add_argument("--refine-drafter", default="drafter", help="which drafter directory of DIR to refine")
    ap.add_argument("--refine-prompt", type=int, default=24, help="corpus tokens each generated sequence starts from")
    ap.add_argument("--refine-tokens", type=int, default=96, help="tokens the target generates per sequence")
    ap.add_argument("--refine-reuse", type=int, default=2, help="drafter steps per generated batch")
    ap.add_argument("--refine-lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    drafter_shapes = args.drafter or [parse_shape("layers=1,hidden=128,heads=2,kv=2,ffn=384")]
    if args.vocab < 300 or args.seq < 16 or args.batch < 1 or args.time_budget_s <= 0:
        ap.error("need --vocab >= 300, --seq >= 16, --batch >= 1, --time-budget-s > 0")
    if not 0 <= args.drafter_share < 1:
        ap.error("--drafter-share must be in [0, 1)")

    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    torch.backends.cuda.matmul.allow_tf32 = True
    random.seed(args.seed)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    if args.refine:
        return refine(args, log)

    files = corpus_files(args.corpus, int(args.max_corpus_mb * 1e6))
    texts = read_texts(files)
    log(f"corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} MB from {args.corpus}")
    tok = train_tokenizer(texts, args.vocab)
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    sample = texts[0][:2000]
    if tok.decode(tok.encode(sample).ids) != sample:
        raise SystemExit("train_demo_pair: the tokenizer does not round-trip the corpus text")
    # hold out every 50th file (whole files: windows of held-out text never overlap training text)
    train_texts = [t for i, t in enumerate(texts) if i % 50 != 7] or texts
    val_texts = [t for i, t in enumerate(texts) if i % 50 == 7] or texts[:1]
    train_ids, val_ids = encode_corpus(tok, train_texts, eos_id), encode_corpus(tok, val_texts, eos_id)
    log(f"tokenizer: vocab {vocab}, {len(train_ids) / 1e6:.2f}M training tokens "
        f"({sum(map(len, train_texts)) / len(train_ids):.2f} chars/token), {len(val_ids) / 1e3:.0f}K held out")

    max_pos = max(2048, args.seq)
    target = new_model(make_config(args.target, vocab, max_pos, "demo-target"), args.seed, dev)
    drafters = [new_model(make_config(s, vocab, max_pos, "demo-drafter"), args.seed + 1 + i, dev)
                for i, s in enumerate(drafter_shapes)]
    for net, role in [(target, "target"), *((d, f"drafter {i}") for i, d in enumerate(drafters))]:
        err = check_forward_matches(net, vocab)
        if err > 1e-3:
            raise SystemExit(f"train_demo_pair: the training forward disagrees with Transformer.forward "
                             f"({role}: max |diff| {err:.2e})")
        log(f"{role}: {net.cfg.n_params() / 1e6:.2f}M params, {net.cfg.n_layers} layers x {net.cfg.hidden_size}; "
            f"training forward == engine forward (max |diff| {err:.1e})")
    fused = {"fused": True} if dev.type == "cuda" else {}
    opt_t = torch.optim.AdamW(target.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    opt_d = [torch.optim.AdamW(d.parameters(), lr=args.drafter_lr, betas=(0.9, 0.95), weight_decay=0.05, **fused)
             for d in drafters]

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")

    train_b = Batches(train_ids, args.seq, dev, args.seed)
    val_b = Batches(val_ids, min(args.seq, len(val_ids) - 2), dev, args.seed + 99)
    budget_joint = args.time_budget_s * (1 - args.drafter_share)
    history: list[dict] = []
    best = {"loss": float("inf"), "state": None, "step": 0}

    def drafter_step(x, y, teacher, progress):
        out = []
        for d, o in zip(drafters, opt_d, strict=True):
            for gr in o.param_groups:
                gr["lr"] = lr_at(progress, args.drafter_lr)
            with autocast():
                loss = kd_loss(train_logits(d, x), teacher, y, args.kd_ce)
            o.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            o.step()
            out.append(loss)
        return out

    def check_eval(step: int, phase: str, t_loss, d_losses, tokens: int, force: bool = False) -> None:
        nonlocal next_eval
        if not force and time.perf_counter() < next_eval:
            return
        next_eval = time.perf_counter() + args.eval_every_s
        ev = evaluate(target, drafters, val_b, 4, min(16, args.batch), autocast)
        ev.update(step=step, phase=phase, elapsed_s=time.perf_counter() - t_train,
                  train_loss=float(t_loss.detach()) if t_loss is not None else None,
                  drafter_kd_loss=[float(v.detach()) for v in d_losses])
        history.append(ev)
        if phase == "joint" and ev["target_val_loss"] < best["loss"]:
            best.update(loss=ev["target_val_loss"], step=step,
                        state={k: v.detach().clone() for k, v in target.state_dict().items()})
        rate = tokens / max(1e-9, time.perf_counter() - t_train)
        agree = " ".join(f"{a:.3f}" for a in ev["drafter_top1_agreement"])
        log(f"{phase} step {step}: target train {ev['train_loss'] or float('nan'):.3f} val "
            f"{ev['target_val_loss']:.3f} | drafter kd {' '.join(f'{v:.3f}' for v in ev['drafter_kd_loss'])} "
            f"val {' '.join(f'{v:.3f}' for v in ev['drafter_val_loss'])} top-1 agreement {agree} | "
            f"{rate / 1e3:.0f}K tok/s")

    # phase 1: the target on the corpus, the drafters on the target's distribution, step by step
    t_train = time.perf_counter()
    next_eval = t_train + args.eval_every_s
    step = tokens = 0
    t_loss = None
    d_losses: list = []
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - t_train) / budget_joint)
        if progress >= 1:
            break
        x, y = train_b.get(args.batch)
        for gr in opt_t.param_groups:
            gr["lr"] = lr_at(progress, args.lr)
        with autocast():
            logits = train_logits(target, x)
            t_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt_t.zero_grad(set_to_none=True)
        t_loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt_t.step()
        d_losses = drafter_step(x, y, logits.detach(), progress)
        step += 1
        tokens += x.numel()
        check_eval(step, "joint", t_loss, d_losses, tokens, force=step == 1)
    check_eval(step, "joint", t_loss, d_losses, tokens, force=True)
    joint_steps = step
    target.load_state_dict(best["state"])
    target.eval()
    log(f"target: kept the checkpoint of step {best['step']} (validation loss {best['loss']:.3f})")

    # phase 2: the drafters alone against the kept target, learning rates restarted lower
    t2 = time.perf_counter()
    budget2 = args.time_budget_s - (t2 - t_train)
    step2 = 0
    while budget2 > 0 and step2 < args.steps:
        progress = (time.perf_counter() - t2) / budget2
        if progress >= 1:
            break
        x, y = train_b.get(args.batch)
        with torch.no_grad(), autocast():
            teacher = train_logits(target, x)
        d_losses = drafter_step(x, y, teacher, 0.5 + 0.5 * progress)  # the second half of the cosine
        step2 += 1
        check_eval(joint_steps + step2, "drafter", None, d_losses, tokens + step2 * x.numel())
    check_eval(joint_steps + step2, "drafter", None, d_losses, tokens, force=True)

    # acceptance along the target's greedy continuations of the demo's prompts, then save
    accept = [estimate_acceptance(target, d, tok, DEMO_PROMPTS, 64, 4) for d in drafters]
    for i, a in enumerate(accept):
        log(f"drafter {i}: estimated greedy acceptance at k=4: {a['mean_accepted']:.2f} drafts per round, by "
            f"position {' '.join(f'{v:.2f}' for v in a['accept_rate_by_pos'])}")
    os.makedirs(args.out, exist_ok=True)
    tok_json = tok.to_str()
    sizes = {"target": save_pair_member(target, os.path.join(args.out, "target"), tok_json, eos_id)}
    for i, d in enumerate(drafters):
        name = "drafter" if i == 0 else f"drafter-{i}"
        sizes[name] = save_pair_member(d, os.path.join(args.out, name), tok_json, eos_id)
    # the saved files, read back by the engine's loader, still compute what was trained
    reloaded = load_hf_dir(os.path.join(args.out, "target"), device="cpu", dtype=torch.float32)
    err = check_forward_matches(reloaded, vocab)
    if err > 1e-3:
        raise SystemExit(f"train_demo_pair: the saved target disagrees with the training forward ({err:.2e})")
    sample_text = tok.decode(greedy(reloaded, tok.encode(DEMO_PROMPTS[0]).ids, 64)[0].tolist())
    log("target's greedy continuation of the first demo prompt:\n" + sample_text)
    info = {
        "corpus": {"root": args.corpus, "python": sys.version.split()[0], "files": len(files),
                   "chars": sum(map(len, texts)), "train_tokens": len(train_ids), "val_tokens": len(val_ids)},
        "tokenizer": {"kind": "byte-level BPE", "vocab": vocab, "eos": EOS, "eos_id": eos_id},
        "target": {**args.target, "params": target.cfg.n_params()},
        "drafters": [{**s, "params": d.cfg.n_params()} for s, d in zip(drafter_shapes, drafters, strict=True)],
        "training": {"device": str(dev), "torch": torch.__version__, "seq": args.seq, "batch": args.batch,
                     "time_budget_s": args.time_budget_s, "joint_steps": joint_steps, "drafter_steps": step2,
                     "target_kept_step": best["step"], "lr": args.lr, "drafter_lr": args.drafter_lr,
                     "kd_ce": args.kd_ce, "seed": args.seed},
        "history": history, "estimated_acceptance": accept, "weight_bytes": sizes, "sample": sample_text,
    }
    with open(os.path.join(args.out, "TRAINING.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"wrote {args.out}: weights {', '.join(f'{k} {v / 1e6:.2f} MB' for k, v in sizes.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
