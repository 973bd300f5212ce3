"""Train kvlab's shipped models: ``kvlab-tiny`` (target) and ``kvlab-tiny-draft``.

Everything is regenerated from a seed, offline, on CPU:

1. the corpus: ``kvlab.models.corpus.generate_corpus(seed, N)`` (procedural English, ~10 MB);
2. a byte-level BPE tokenizer (1024 tokens incl. ``<|bos|>`` / ``<|eos|>``) trained with the
   ``tokenizers`` library on the first documents;
3. two Hugging Face ``LlamaForCausalLM`` models (GQA, RoPE, tied embeddings, float32), trained
   with AdamW in a plain torch loop on packed 256-token windows;
4. the model directories ``kvlab/models/<name>/`` in Hugging Face layout (``config.json``,
   ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
   ``generation_config.json``) plus ``training_info.json`` (figures of this run).

Run from the repository root (about 8-10 minutes on 2 idle CPU cores)::

    .venv/bin/python tools/train_models.py            # writes kvlab/models/kvlab-tiny*/
    .venv/bin/python tools/train_models.py --quick --out /tmp/m   # smoke test, seconds

Same seed -> same corpus and tokenizer bytes; the weights are bit-identical on the same machine
and thread count (``--threads``, default 2), as all randomness flows from the seed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvlab.entrypoints.chat_template import KVLAB_CHAT_TEMPLATE  # noqa: E402
from kvlab.models.corpus import (  # noqa: E402
    CORPUS_SEED,
    corpus_words,
    generate_corpus,
    sample_prompts,
    shared_prefix_prompts,
)

BOS, EOS = "<|bos|>", "<|eos|>"
VOCAB_SIZE = 1024
NUM_TRAIN_DOCS = 16_000  # ~9.6 MB of text, ~2.9 M tokens
NUM_TOKENIZER_DOCS = 4_000
HELDOUT_START = 1_000_000  # document indices of the held-out split (never trained on)
NUM_HELDOUT_DOCS = 300


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and optimisation of one shipped model."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int


TARGET = ModelSpec("kvlab-tiny", 192, 512, 4, 6, 2, steps=700, batch_size=16, seq_len=256,
                   lr=3e-3, warmup=40)
DRAFT = ModelSpec("kvlab-tiny-draft", 128, 320, 2, 4, 2, steps=700, batch_size=16, seq_len=256,
                  lr=4e-3, warmup=40)


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- data


def train_tokenizer(docs: list[str]) -> Tokenizer:
    """Byte-level BPE with ``VOCAB_SIZE`` tokens; ids 0/1 are ``<|bos|>``/``<|eos|>``.

    ``encode`` prepends ``<|bos|>`` (as the models were trained); ``decode`` drops specials.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if (bos_id, eos_id) != (0, 1) or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"unexpected tokenizer layout: {bos_id}, {eos_id}, "
                           f"{tok.get_vocab_size()}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)]
    )
    return tok


def token_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one int64 stream: ``<|bos|> doc <|eos|> <|bos|> doc <|eos|> ...``."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):  # encode() adds <|bos|>
        ids.extend(enc.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len]`` windows of the stream (the tail is dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


# --------------------------------------------------------------------------- models


def llama_config(spec: ModelSpec) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.02,
    )


def lr_at(step: int, spec: ModelSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(spec: ModelSpec, data: torch.Tensor, seed: int) -> tuple[LlamaForCausalLM, dict]:
    """Train one model on ``data`` windows; returns the model and its training figures."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(spec))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(data.shape[0], generator=gen)
    start = time.perf_counter()
    losses: list[float] = []
    cursor = 0
    for step in range(spec.steps):
        if cursor + spec.batch_size > order.numel():
            order = torch.randperm(data.shape[0], generator=gen)
            cursor = 0
        batch = data[order[cursor: cursor + spec.batch_size]]
        cursor += spec.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"  [{spec.name}] step {step:4d}/{spec.steps}  loss {loss.item():.3f}  "
                f"lr {lr_at(step, spec):.2e}  {time.perf_counter() - start:6.1f}s")
    model.eval()
    tail = losses[-20:]
    figures = {
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_loss_last20": round(sum(tail) / len(tail), 4),
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
    }
    return model, figures


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, data: torch.Tensor) -> float:
    """Mean per-token cross-entropy (nats) over the held-out windows."""
    total, count = 0.0, 0
    for i in range(0, data.shape[0], 32):
        batch = data[i: i + 32]
        logits = model(input_ids=batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def greedy(model: LlamaForCausalLM, ids: list[int], max_new: int) -> list[int]:
    """Greedy continuation (no KV cache needed at this size: full forward each step)."""
    seq = torch.tensor([ids])
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model(input_ids=seq).logits[0, -1].argmax())
        if nxt == 1:
            break
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def agreement(target: LlamaForCausalLM, draft: LlamaForCausalLM, tok: Tokenizer,
              prompts: list[str], max_new: int) -> float:
    """Fraction of the target's greedy tokens that the draft's argmax also picks (teacher-forced
    on the target's continuation): the greedy acceptance rate of speculative decoding."""
    agree = total = 0
    for prompt in prompts:
        ids = tok.encode(prompt).ids
        cont = greedy(target, ids, max_new)
        if not cont:
            continue
        seq = torch.tensor([ids + cont])
        pred = draft(input_ids=seq).logits[0, len(ids) - 1: -1].argmax(-1)
        agree += int((pred == torch.tensor(cont)).sum())
        total += len(cont)
    return agree / max(1, total)


def word_fraction(texts: list[str], vocab: set[str]) -> float:
    words = [w for t in texts for w in sorted(corpus_words([t]))]
    return sum(w in vocab for w in words) / max(1, len(words))


# --------------------------------------------------------------------------- output


def write_model_dir(out: Path, spec: ModelSpec, model: LlamaForCausalLM, tok: Tokenizer,
                    info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(spec).to_dict()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": cfg["initializer_range"],
        "torch_dtype": "float32",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to model.embed_tokens.weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": KVLAB_CHAT_TEMPLATE,   # kvlab serve's chat format, with the BOS
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": 1, "do_sample": False, "max_new_tokens": 128,
    }, indent=2) + "\n")
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=CORPUS_SEED)
    ap.add_argument("--out", type=Path, default=REPO / "kvlab" / "models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (few steps/docs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    specs = [TARGET, DRAFT]
    num_docs = NUM_TRAIN_DOCS
    if args.quick:
        specs = [ModelSpec(**{**asdict(s), "steps": 12, "warmup": 2}) for s in specs]
        num_docs = 800

    log(f"corpus: seed {args.seed}, {num_docs} training documents")
    docs = generate_corpus(args.seed, num_docs)
    heldout_docs = generate_corpus(args.seed, NUM_HELDOUT_DOCS, start=HELDOUT_START)
    text = "\n\x00".join(docs).encode()
    corpus_sha = hashlib.sha256(text).hexdigest()
    log(f"  {len(text) / 1e6:.2f} MB, sha256 {corpus_sha[:16]}")
    tok = train_tokenizer(docs[:NUM_TOKENIZER_DOCS])
    tok_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    train_stream = token_stream(tok, docs)
    heldout_stream = token_stream(tok, heldout_docs)
    log(f"tokenizer: {tok.get_vocab_size()} tokens, sha256 {tok_sha[:16]}; "
        f"{train_stream.numel():,} training tokens, {heldout_stream.numel():,} held-out, "
        f"{len(text) / train_stream.numel():.2f} bytes/token")

    vocab = corpus_words(docs)
    prompts = sample_prompts(args.seed + 1, 12) + shared_prefix_prompts(args.seed + 1, 4)
    agreement_prompts = sample_prompts(args.seed + 2, 40)
    trained: dict[str, LlamaForCausalLM] = {}
    infos: dict[str, dict] = {}
    for spec in specs:
        log(f"training {spec.name}: {spec}")
        model, figures = train(spec, windows(train_stream, spec.seq_len), args.seed)
        heldout = heldout_loss(model, windows(heldout_stream, spec.seq_len))
        samples = []
        for p in prompts:
            cont = tok.decode(greedy(model, tok.encode(p).ids, 48))
            samples.append({"prompt": p, "continuation": cont})
        n_params = sum(p.numel() for p in model.parameters())
        figures.update({
            "parameters": n_params,
            "heldout_loss": round(heldout, 4),
            "uniform_loss": round(math.log(VOCAB_SIZE), 4),
            "generated_word_fraction_in_corpus_vocab": round(
                word_fraction([s["continuation"] for s in samples], vocab), 4),
        })
        log(f"  {spec.name}: {n_params:,} parameters, train loss {figures['train_loss_last20']:.3f}"
            f", held-out loss {heldout:.3f} (uniform {math.log(VOCAB_SIZE):.3f}), "
            f"{figures['train_seconds']}s")
        for s in samples[:6] + samples[-2:]:
            log(f"    {s['prompt'][-60:]!r} -> {s['continuation']!r}")
        trained[spec.name] = model
        infos[spec.name] = {
            "spec": asdict(spec),
            "seed": args.seed,
            "corpus": {"generator": "kvlab.models.corpus.generate_corpus", "seed": args.seed,
                       "num_docs": num_docs, "sha256": corpus_sha, "bytes": len(text)},
            "heldout": {"start": HELDOUT_START, "num_docs": NUM_HELDOUT_DOCS},
            "tokenizer_sha256": tok_sha,
            "torch_version": torch.__version__,
            "threads": args.threads,
            **figures,
            "samples": samples,
        }

    rate = agreement(trained[specs[0].name], trained[specs[1].name], tok, agreement_prompts, 48)
    log(f"greedy agreement draft vs target on {len(agreement_prompts)} held-out prompts: "
        f"{rate:.3f}")
    total = time.perf_counter() - t0
    for spec in specs:
        infos[spec.name]["greedy_agreement_with_pair"] = round(rate, 4)
        infos[spec.name]["script_seconds_total"] = round(total, 1)
        write_model_dir(args.out / spec.name, spec, trained[spec.name], tok, infos[spec.name])
    sizes = {s.name: (args.out / s.name / "model.safetensors").stat().st_size for s in specs}
    log(f"wrote {args.out}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items())
        + f"; total {sum(sizes.values()) / 1e6:.2f} MB; {total:.0f}s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
