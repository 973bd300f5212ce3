"""vLLM's tokenizer routes on ``kvlab serve`` (kvlab.entrypoints.tokenization): ``/tokenize``
(completion and chat forms), ``/detokenize``, the opt-in ``/tokenizer_info``, their errors, and
lm-eval's probe for a server-side tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest

from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.chat_template import conversation
from kvlab.entrypoints.serve import build_app, chat_template
from kvlab.entrypoints.uvicorn_server import ServerThread

MODEL = "kvlab-tiny"
TEXT = "Trern Thyvet was a generous shepherd 🐑 who lived in 東京"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineArgs(MODEL, max_model_len=128, max_num_seqs=4))


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(AsyncEngine(engine, model_name=MODEL), MODEL, max_body_bytes=4096,
                    tokenizer_info_endpoint=True)
    with ServerThread(app) as srv:
        yield srv.url


def post(url: str, path: str, body) -> httpx.Response:
    # ASCII-escaped JSON: a lone surrogate travels as the text "\ud800", as clients send it
    return httpx.post(url + path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=60)


def test_tokenize_a_prompt_as_the_engine_does(server, engine):
    tok = engine.tokenizer
    r = post(server, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(TEXT)
    assert ids[0] == engine.config.bos_token_id            # add_special_tokens: true
    assert body == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                    "token_strs": None}
    r = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                   "return_token_strs": True}).json()
    assert r["tokens"] == ids[1:] == tok.encode(TEXT, add_special_tokens=False)
    vocab = tok.get_vocab()
    assert [vocab[s] for s in r["token_strs"]] == r["tokens"]
    assert any(s != tok.decode([i]) for s, i in zip(r["token_strs"], r["tokens"], strict=True))
    # /detokenize inverts it; special tokens are kept, as in vLLM
    back = post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert back["prompt"].endswith(TEXT) and back["prompt"] != TEXT   # "<|bos|>" first
    assert post(server, "/detokenize", {"tokens": ids[1:]}).json() == {"prompt": TEXT}


def test_tokenize_chat_gives_the_tokens_chat_completions_runs(server, engine):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Who"},
                                             {"type": "text", "text": "lived there?"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "Well?"}]
    r = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = chat_template(engine).render(conversation(messages)[0])
    assert ids == engine.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == engine.config.bos_token_id and ids[1] != ids[0]   # the template's BOS
    answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                     "max_tokens": 1, "temperature": 0})
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)
    open_ended = post(server, "/tokenize", {"messages": messages,
                                            "add_generation_prompt": False}).json()["tokens"]
    assert engine.tokenizer.decode(ids).endswith("\nassistant:")
    assert engine.tokenizer.decode(open_ended) + "\nassistant:" == \
        engine.tokenizer.decode(ids)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
    ("/tokenize", {"messages": [], "tools": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1024]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"prompt": "x"}, 400, "tokens"),
])
def test_bad_tokenizer_requests_name_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_routes_refuse_bodies_over_the_limit_and_bad_json(server):
    r = post(server, "/tokenize", {"prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server + "/detokenize", content=b"{not json", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_tokenizer_info_and_its_chat_template(server, engine):
    jinja2 = pytest.importorskip("jinja2")
    info = httpx.get(server + "/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert engine.tokenizer.get_vocab()[info["eos_token"]] == engine.eos_token_ids[0]
    assert info["chat_template"] == chat_template(engine).source
    # whitespace-safe: a plain Jinja environment (no trim_blocks) renders it the same
    template = jinja2.Environment().from_string(info["chat_template"])
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "developer", "content": "Be kind.\nAlways."},
                      {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "and?"}]):
        assert template.render(messages=messages, add_generation_prompt=True,
                               bos_token=info["bos_token"]) == \
            chat_template(engine).render(conversation(messages)[0])


def test_tokenizer_info_is_opt_in(engine):
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        r = httpx.get(srv.url + "/tokenizer_info", timeout=60)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert post(srv.url, "/tokenize", {"prompt": "a"}).status_code == 200


def test_lm_eval_finds_and_uses_the_server_tokenizer(server, engine):
    """lm-eval's ``local-completions`` picks its ``remote`` tokenizer backend when the server
    answers ``/tokenizer_info`` and ``/tokenize``; its RemoteTokenizer then encodes and decodes
    as kvlab's tokenizer does (without special tokens)."""
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server + "/v1/completions")
    tok = utils.RemoteTokenizer(server + "/v1/completions")
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    assert tok.encode(TEXT) == ids and tok.decode(ids) == TEXT
    assert tok.eos_token_id == engine.eos_token_ids[0]
    assert tok.bos_token_id == engine.config.bos_token_id


def test_tokenize_takes_vllms_chat_fields_and_ignores_unknown_ones(server, engine):
    """vLLM 0.32 (``TokenizeChatRequest``, ``vllm/entrypoints/serve/tokenize/protocol.py``):
    ``add_special_tokens`` (default false for chat) adds the tokenizer's BOS on top of the one
    the template writes; fields the request model does not define are ignored, not refused."""
    messages = [{"role": "user", "content": "hi"}]
    plain = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    doubled = post(server, "/tokenize", {"messages": messages, "add_special_tokens": True,
                                         "truncate": 3}).json()["tokens"]
    bos = engine.config.bos_token_id
    assert plain[0] == bos and plain[1] != bos and doubled == [bos, *plain]
    r = post(server, "/tokenize", {"prompt": "a b", "frobnicate": 1})
    assert r.status_code == 200 and r.json()["tokens"] == engine.tokenizer.encode("a b")
