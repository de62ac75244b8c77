"""`python -m sparrow.train`: a small model of Qwen3.5/3.6's architecture (Gated DeltaNet,
gated attention, MoE with a shared expert) trained on the Python standard library's own
source, which every machine with Python has offline and which the PSF license lets anyone
redistribute. Seeded; on the CPU a few minutes give a model that writes Python-looking text
(8 minutes on 2 cores: 946 steps, held-out perplexity 32.4 over a 4,096-token vocabulary).

The corpus is every `.py` file of the running interpreter's standard library (no
site-packages), one file in `HELD_OUT` held out by a stable hash of its path. A byte-level
BPE tokenizer (HF `tokenizers`) is trained on it with Qwen's special tokens, so that the
model also answers in ChatML: half of the training sequences are plain source, half one chat
turn whose user message is the start of a file and whose reply (after the empty think block
the template writes when thinking is off) continues it. Training runs HF transformers'
`Qwen3_5MoeForCausalLM` (the oracle the engine matches); the checkpoint is written as the
Qwen3.5/3.6 releases are laid out (`loader.writer.save_checkpoint`: nested config.json,
`model.language_model.*`, fused experts) in bf16 with `tokenizer.json`, the chat template
and HF's generation config, so the engine, HF transformers and mlx-lm read it unchanged.

    pip install -e '.[test]'   # transformers
    python -m sparrow.train --out trained-model --minutes 8   # or --steps N: reproducible
    sparrow generate --model trained-model --prompt "def fibonacci("
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

from sparrow.chat_templates import CHATML_TEMPLATE

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# as in Qwen's vocabulary, the think markers are added tokens that are not special: decoded
# text keeps them (skip_special_tokens drops the special ones)
TEXT_MARKERS = ("<think>", "</think>")
HELD_OUT = 20  # one file in 20 is held out (by a hash of its relative path)
MODEL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)


def corpus(max_files: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(training texts, held-out texts): the standard library's Python files, sorted (the
    first `max_files` of them, for a quick run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py"))[:max_files]:
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = int(hashlib.sha256(rel.encode()).hexdigest(), 16)
        (held if digest % HELD_OUT == 0 else train).append(text)
    return tuple(train), tuple(held)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE over the texts, Qwen's special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, path: Path) -> None:
    """`tok` as tokenizer.json, the `TEXT_MARKERS` not special."""
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in TEXT_MARKERS
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def chat_turn(prefix: str, rest: str) -> str:
    """One training turn as the built-in ChatML template renders it, thinking off."""
    return (
        f"<|im_start|>user\n{prefix}<|im_end|>\n<|im_start|>assistant\n"
        f"<think>\n\n</think>\n\n{rest}<|im_end|>\n"
    )


@functools.cache
def _cumulative_lengths(texts: tuple[str, ...]) -> list[int]:
    return list(itertools.accumulate(map(len, texts)))


def samples(texts: tuple[str, ...], rng: random.Random, chars: int) -> str:
    """One training text (its file drawn in proportion to its length, so that a small file
    is not seen over and over): a window of a file, or (half the time) a chat turn whose user
    message is a file's first lines and whose reply continues it."""
    text = rng.choices(texts, cum_weights=_cumulative_lengths(texts))[0]
    if rng.random() < 0.5:
        start = rng.randrange(max(1, len(text) - chars))
        return text[start : start + chars]
    cut = rng.randrange(20, 200)
    return chat_turn(text[:cut], text[cut : cut + chars])


def batch(tok, texts, rng, size: int, length: int) -> torch.Tensor:
    rows = []
    while len(rows) < size:
        ids = tok.encode(samples(texts, rng, 6 * length)).ids[:length]
        if len(ids) == length:
            rows.append(ids)
    return torch.tensor(rows)


@torch.no_grad()
def held_out_loss(model, tok, texts: tuple[str, ...], length: int, windows: int = 16) -> float:
    rng = random.Random(1)
    x = batch(tok, texts, rng, windows, length).to(model.device)
    return model(input_ids=x, labels=x).loss.item()


def save_release(model, out: Path) -> None:
    """HF's trained model in bf16 as the release layout of its family, and its generation
    config."""
    from sparrow.loader.weights import load_tensors
    from sparrow.loader.writer import save_checkpoint
    from sparrow.models import model_args_from_hf

    model = model.to("cpu", torch.bfloat16)
    cfg = model_args_from_hf(model.config.to_dict())
    ours = load_tensors(cfg, model.state_dict(), "cpu", torch.bfloat16, where="trained model")
    save_checkpoint(ours, out, torch.bfloat16)
    model.generation_config.save_pretrained(out)


def main(argv: list[str] | None = None) -> Path:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--minutes", type=float, default=5.0, help="training time")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps instead")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to train: cpu, cuda")
    p.add_argument("--max-files", type=int, default=None, help="of the corpus (a quick run)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train, held = corpus(args.max_files)
    tok = train_tokenizer(train[::4], args.vocab)  # a quarter of the files: the merges settle
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=tok.get_vocab_size(),
        **MODEL,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    model = Qwen3_5MoeForCausalLM(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start, step = time.monotonic(), 0

    def progress() -> float:
        return step / args.steps if args.steps else (time.monotonic() - start) / 60 / args.minutes

    while progress() < 1:
        # linear warm-up over 50 steps, then a cosine decay to a tenth
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * progress()))
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * decay
        x = batch(tok, train, rng, args.batch, args.length).to(args.device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 50 == 0:
            print(f"[train] step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    held_loss = held_out_loss(model, tok, held, args.length)
    out = Path(args.out)
    save_release(model, out)
    save_tokenizer(tok, out / "tokenizer.json")
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (out / "training.json").write_text(
        json.dumps(
            {
                "corpus": "the Python standard library's .py files (PSF license)",
                "python": sysconfig.get_python_version(),
                "steps": step,
                "seed": args.seed,
                "batch": args.batch,
                "length": args.length,
                "lr": args.lr,
                "device": args.device,
                "vocab": tok.get_vocab_size(),
                "held_out_loss": held_loss,
                "held_out_perplexity": float(torch.tensor(held_loss).exp()),
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"[train] {step} steps; held-out loss {held_loss:.3f} "
        f"(perplexity {torch.tensor(held_loss).exp():.1f}); wrote {out}",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
