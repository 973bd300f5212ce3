"""The shipped models (kvlab-tiny, kvlab-tiny-draft), their corpus and their registry."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.models import (
    DRAFT_FOR,
    SHIPPED_MODELS,
    is_shipped_model,
    shipped_model_path,
)
from kvlab.models.corpus import (
    CORPUS_SEED,
    SYSTEM_PROMPT,
    build_world,
    corpus_words,
    generate_corpus,
    qa_examples,
    sample_prompts,
    shared_prefix_prompts,
)

REPO = Path(__file__).resolve().parent.parent
NAMES = ["kvlab-tiny", "kvlab-tiny-draft"]
# Held-out documents for these tests: far from the training range (0..15999) and from the
# script's own held-out split, so neither the models nor their selection have seen them.
TEST_START = 2_000_000


def _load_train_script():
    name = "kvlab_tools_train_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools/train_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _info(name: str) -> dict:
    return json.loads((shipped_model_path(name) / "training_info.json").read_text())


# --------------------------------------------------------------------------- registry


def test_registry_lists_both_models_and_their_pairing():
    assert sorted(SHIPPED_MODELS) == NAMES
    assert DRAFT_FOR == {"kvlab-tiny": "kvlab-tiny-draft"}
    for name in NAMES:
        assert is_shipped_model(name)
        path = shipped_model_path(name)
        assert path.is_dir() and path.name == name
        assert path.parent == Path(__file__).resolve().parent.parent / "kvlab" / "models"


@pytest.mark.parametrize("bad", ["kvlab-huge", "", "KVLAB-TINY", "kvlab-tiny/"])
def test_unknown_name_raises_value_error_listing_known_names(bad):
    with pytest.raises(ValueError, match="unknown shipped model") as err:
        shipped_model_path(bad)
    for name in NAMES:
        assert name in str(err.value)
    assert not is_shipped_model(bad)


@pytest.mark.parametrize("bad", [None, 3, ["kvlab-tiny"], b"kvlab-tiny"])
def test_non_string_names_are_not_shipped_models(bad):
    assert not is_shipped_model(bad)
    with pytest.raises(ValueError):
        shipped_model_path(bad)


def test_registry_and_corpus_do_not_import_torch():
    code = ("import sys, kvlab.models, kvlab.models.corpus; "
            "kvlab.models.shipped_model_path('kvlab-tiny'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --------------------------------------------------------------------------- corpus


# sha256 of "\n\x00".join(generate_corpus(0, 50)): pins the generator, on which the shipped
# weights depend. Changing the corpus code means retraining (tools/train_models.py).
PINNED_50 = "588e8c1f07c9683de05440fec79042b089a21698b8a658dc4b4058f61485bbb3"


def _sha(docs: list[str]) -> str:
    return hashlib.sha256("\n\x00".join(docs).encode()).hexdigest()


def test_corpus_is_deterministic_and_pinned():
    first = generate_corpus(CORPUS_SEED, 50)
    assert first == generate_corpus(CORPUS_SEED, 50)
    assert _sha(first) == PINNED_50
    assert generate_corpus(1, 50) != first


def test_corpus_slices_are_independent_of_count():
    whole = generate_corpus(3, 30)
    assert generate_corpus(3, 10) == whole[:10]
    assert generate_corpus(3, 5, start=20) == whole[20:25]
    assert generate_corpus(3, 0) == []


def test_shipped_weights_were_trained_on_this_corpus():
    """The full training corpus regenerates to the hash recorded by the training run."""
    corpus = _info("kvlab-tiny")["corpus"]
    docs = generate_corpus(corpus["seed"], corpus["num_docs"])
    text = "\n\x00".join(docs).encode()
    assert len(text) == corpus["bytes"]
    assert hashlib.sha256(text).hexdigest() == corpus["sha256"]


@pytest.mark.parametrize("args", [(0.5, 3), ("0", 3), (True, 3), (0, -1), (0, 2.0)])
def test_corpus_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        generate_corpus(*args)
    with pytest.raises(ValueError):
        generate_corpus(0, 2, start=-1)


def test_corpus_grammar_agrees():
    docs = generate_corpus(7, 600)
    text = "\n".join(docs)
    for wrong in [r"\b[Tt]hey (is|was|lives|has)\b", r"\b([Hh]e|[Ss]he) (are|were|live)\b",
                  r"\ba [aeiou]", r"\ban (?!hon|hour)[b-df-hj-np-tv-z]", r"\bone \w+ were\b",
                  r"\b(two|three|four|five|six|seven|eight|nine) \w+ was\b"]:
        assert not re.search(wrong, text), wrong
    assert "they are" in text.lower() and "she is" in text.lower()


def test_corpus_facts_are_consistent_across_documents():
    world = build_world(CORPUS_SEED)
    docs = generate_corpus(CORPUS_SEED, 3000)
    for person in world.people[:40]:
        home = world.towns[person.town].name
        for doc in docs:
            claim = f"{person.full} lives in "
            if claim in doc:
                assert doc.split(claim, 1)[1].startswith(home)


def test_prompts_are_deterministic_and_share_the_system_prefix():
    assert sample_prompts(5, 8) == sample_prompts(5, 8)
    assert sample_prompts(5, 8) != sample_prompts(6, 8)
    shared = shared_prefix_prompts(0, 10)
    assert len(set(shared)) > 1
    for p in shared:
        assert p.startswith(SYSTEM_PROMPT + "\n\nUser: ") and p.endswith("\nArchivist:")


# --------------------------------------------------------------------------- artefacts


def test_layout_sizes_and_config():
    total = 0
    for name in NAMES:
        path = shipped_model_path(name)
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["model_type"] == "llama"
        assert config["num_key_value_heads"] < config["num_attention_heads"]
        assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
        assert config["max_position_embeddings"] >= 1024
        assert config["torch_dtype"] == "float32" and "rope_theta" in config
        assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
        total += (path / "model.safetensors").stat().st_size
    assert total <= 10_000_000
    target = json.loads((shipped_model_path(NAMES[0]) / "config.json").read_text())
    draft = json.loads((shipped_model_path(NAMES[1]) / "config.json").read_text())
    assert target["vocab_size"] == draft["vocab_size"]
    assert target["num_hidden_layers"] > draft["num_hidden_layers"]
    assert target["hidden_size"] > draft["hidden_size"]


def test_safetensors_use_hugging_face_names():
    from safetensors import safe_open

    for name in NAMES:
        config = json.loads((shipped_model_path(name) / "config.json").read_text())
        with safe_open(str(shipped_model_path(name) / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        expected = {"model.embed_tokens.weight", "model.norm.weight"}
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
            expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
            expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if not config["tie_word_embeddings"]:
            expected.add("lm_head.weight")
        assert keys == expected


def test_tokenizers_are_shared_and_regenerate_bit_for_bit():
    from tokenizers import Tokenizer

    raw = [(shipped_model_path(n) / "tokenizer.json").read_bytes() for n in NAMES]
    assert raw[0] == raw[1]
    tok = Tokenizer.from_file(str(shipped_model_path(NAMES[0]) / "tokenizer.json"))
    config = json.loads((shipped_model_path(NAMES[0]) / "config.json").read_text())
    assert tok.get_vocab_size() == config["vocab_size"]
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    doc = generate_corpus(CORPUS_SEED, 1, start=TEST_START)[0]
    ids = tok.encode(doc).ids
    assert ids[0] == 0 and 1 not in ids
    assert tok.decode(ids) == doc

    script = _load_train_script()
    retrained = script.train_tokenizer(generate_corpus(CORPUS_SEED, script.NUM_TOKENIZER_DOCS))
    assert retrained.to_str() == tok.to_str()


# --------------------------------------------------------------------------- behaviour


@pytest.fixture(scope="module")
def loaded():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    # One thread: these models are tiny, and with 2+ threads on cores shared with other jobs a
    # forward pass can be ~40x slower (threads wait on each other). Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    models = {
        n: transformers.LlamaForCausalLM.from_pretrained(
            str(shipped_model_path(n)), local_files_only=True).eval()
        for n in NAMES
    }
    tok = Tokenizer.from_file(str(shipped_model_path(NAMES[0]) / "tokenizer.json"))
    yield torch, models, tok
    torch.set_num_threads(threads)


def _greedy(torch, model, ids, max_new):
    out = []
    with torch.no_grad():
        seq = torch.tensor([ids])
        for _ in range(max_new):
            nxt = int(model(input_ids=seq).logits[0, -1].argmax())
            if nxt == 1:
                break
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def test_models_load_as_float32_with_tied_embeddings(loaded):
    torch, models, _ = loaded
    for model in models.values():
        assert model.dtype == torch.float32
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_heldout_loss_far_below_uniform_and_target_beats_draft(loaded):
    torch, models, tok = loaded
    docs = generate_corpus(CORPUS_SEED, 16, start=TEST_START)
    losses = {}
    for name, model in models.items():
        total = count = 0.0
        with torch.no_grad():
            for doc in docs:
                ids = torch.tensor([[*tok.encode(doc).ids, 1]])
                logits = model(input_ids=ids).logits[0, :-1]
                total += float(torch.nn.functional.cross_entropy(
                    logits, ids[0, 1:], reduction="sum"))
                count += ids.shape[1] - 1
        losses[name] = total / count
    uniform = math.log(tok.get_vocab_size())
    assert losses["kvlab-tiny"] < 0.3 * uniform, losses
    assert losses["kvlab-tiny-draft"] < 0.5 * uniform, losses
    assert losses["kvlab-tiny"] < losses["kvlab-tiny-draft"] - 0.05, losses


def test_greedy_continuations_read_like_the_corpus(loaded):
    torch, models, tok = loaded
    vocab = corpus_words(generate_corpus(CORPUS_SEED, 4000))
    prompts = sample_prompts(11, 5) + shared_prefix_prompts(11, 2)
    for name, model in models.items():
        words: list[str] = []
        for prompt in prompts:
            text = tok.decode(_greedy(torch, model, tok.encode(prompt).ids, 32))
            found = re.findall(r"[A-Za-z]+(?:'[a-z]+)?", text)
            assert len(set(found)) >= 3, (name, prompt, text)  # not silent, not one word looped
            words += [w.lower() for w in found]
        known = sum(w in vocab for w in words) / len(words)
        assert known >= 0.9, (name, known)


def test_draft_agrees_with_target_often(loaded):
    torch, models, tok = loaded
    target, draft = models["kvlab-tiny"], models["kvlab-tiny-draft"]
    agree = total = 0
    for prompt in sample_prompts(12, 6):
        ids = tok.encode(prompt).ids
        cont = _greedy(torch, target, ids, 24)
        with torch.no_grad():
            logits = draft(input_ids=torch.tensor([ids + cont])).logits[0]
        pred = logits[len(ids) - 1: -1].argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(pred, cont, strict=True))
        total += len(cont)
    assert total > 0 and agree / total >= 0.6, agree / total


def _answer(torch, model, tok, prompt: str) -> str:
    """Greedy answer line of a Q&A prompt (up to the first newline, at most 40 tokens)."""
    ids, out = tok.encode(prompt).ids, []
    with torch.no_grad():
        seq = torch.tensor([ids])
        for _ in range(40):
            nxt = int(model(input_ids=seq).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == 1 or "\n" in tok.decode(out):
                break
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return tok.decode(out).split("\n")[0].strip()


def test_target_knows_more_facts_of_the_world_than_the_draft(loaded):
    torch, models, tok = loaded
    examples = qa_examples(13, 24)  # ~69% right for the shipped target on 120 questions
    right = {name: sum(_answer(torch, model, tok, prompt) == answer for prompt, answer in examples)
             for name, model in models.items()}
    assert right["kvlab-tiny"] >= 9, right
    assert right["kvlab-tiny"] >= right["kvlab-tiny-draft"] + 5, right


def test_training_stream_and_schedule():
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer

    script = _load_train_script()
    tok = Tokenizer.from_file(str(shipped_model_path(NAMES[0]) / "tokenizer.json"))
    docs = generate_corpus(CORPUS_SEED, 3, start=TEST_START)
    stream = script.token_stream(tok, docs)
    bounds = (stream == 0).nonzero().flatten().tolist()
    assert stream[0] == 0 and stream[-1] == 1 and len(bounds) == 3
    pieces = [stream[a:b] for a, b in zip(bounds, [*bounds[1:], stream.numel()], strict=True)]
    for doc, piece in zip(docs, pieces, strict=True):
        assert piece[-1] == 1 and tok.decode(piece.tolist()) == doc
    win = script.windows(stream, 64)
    assert win.shape == (stream.numel() // 64, 64) and torch.equal(win[1], stream[64:128])
    spec = script.TARGET
    rates = [script.lr_at(s, spec) for s in range(spec.steps)]
    assert rates[0] < rates[spec.warmup - 1] == pytest.approx(spec.lr)
    assert max(rates) == pytest.approx(spec.lr) and rates[-1] >= 0.1 * spec.lr * 0.999
    assert all(a >= b for a, b in zip(rates[spec.warmup:], rates[spec.warmup + 1:], strict=False))
