"""The chat template kvlab publishes renders, everywhere it is rendered, the token ids kvlab's
server runs.

Three renderers, one corpus of conversations (system, developer, user, assistant with and
without tool calls, tool turns, text parts, non-ASCII, continued final turns): kvlab's server
(``/tokenize`` and ``usage.prompt_tokens`` of ``/v1/chat/completions``), transformers'
``apply_chat_template`` on kvlab-tiny's own ``tokenizer_config.json`` (no template passed: the
checkpoint carries it), and vLLM 0.32's renderer (``HfRenderer.render_messages``,
``vllm/renderers/hf.py``; what ``vllm serve kvlab-tiny`` runs without ``--chat-template``) where
vLLM is installed. The two earlier causes of a mismatch are pinned: Jinja's ``trim_blocks``
(which ate the newline written after a block tag) and the BOS (the template writes it; chat
prompts are encoded without special tokens).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.chat_template import KVLAB_CHAT_TEMPLATE, ChatTemplate, conversation
from kvlab.entrypoints.serve import build_app, chat_template
from kvlab.entrypoints.uvicorn_server import ServerThread
from kvlab.models import shipped_model_path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "kvlab-tiny"

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"place": "Vale", "max": 3}'}}
CORPUS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Vale?"}],
    [{"role": "developer", "content": "Answer in Vale's words.\nNo lists."},
     {"role": "system", "content": "You are a guide."},
     {"role": "user", "content": "Who lit the lamps?"},
     {"role": "assistant", "content": "The lamplighter."},
     {"role": "user", "content": "And then?"}],
    [{"role": "system", "content": "Use tools."},
     {"role": "user", "content": "How far is Vale?"},
     {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "3 leagues north"},
     {"role": "assistant", "content": "Three leagues."},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "Two calls"},
     {"role": "assistant", "content": "Checking both.", "tool_calls": [
         CALL, {"id": "call_2", "type": "function",
                "function": {"name": "weather", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "north"},
     {"role": "tool", "tool_call_id": "call_2", "content": "rain, 12 °C"}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                  {"type": "text", "text": "Part two: 中文 😀"}]}],
    [{"role": "user", "content": "  leading and trailing spaces  \n"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "\n\nblank lines\n\n"}],
]
#: (conversation index, add_generation_prompt, continue_final_message)
CASES = [(i, True, False) for i in range(len(CORPUS))] + [(1, False, False), (2, False, False)]
CONTINUED = [{"role": "user", "content": "Who lit the lamps?"},
             {"role": "assistant", "content": "The lamplighter of"}]


def _hf_messages(messages: list[dict]) -> list[dict]:
    """The conversation as transformers takes it: tool-call arguments as objects (its chat
    templates' convention, and what vLLM passes them as)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=512))
    app = build_app(AsyncEngine(engine, model_name=MODEL), MODEL, tokenizer_info_endpoint=True)
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv


def _post(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def kvlab_ids(server) -> list[list[int]]:
    """The token ids kvlab's server runs for each case (``/tokenize``, checked against the
    chat route's prompt count)."""
    out = []
    for i, gen, cont in CASES:
        body = {"model": MODEL, "messages": CORPUS[i], "add_generation_prompt": gen,
                "continue_final_message": cont}
        ids = _post(server, "/tokenize", body)["tokens"]
        usage = _post(server, "/v1/chat/completions", {**body, "max_tokens": 1})["usage"]
        assert usage["prompt_tokens"] == len(ids)
        out.append(ids)
    ids = _post(server, "/tokenize", {"model": MODEL, "messages": CONTINUED,
                                      "add_generation_prompt": False,
                                      "continue_final_message": True})["tokens"]
    return [*out, ids]


def test_transformers_renders_the_servers_token_ids(server, kvlab_ids):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(shipped_model_path(MODEL))
    assert tok.chat_template == KVLAB_CHAT_TEMPLATE          # shipped in tokenizer_config.json
    for (i, gen, cont), ids in zip(CASES, kvlab_ids, strict=False):
        got = tok.apply_chat_template(_hf_messages(CORPUS[i]), add_generation_prompt=gen,
                                      continue_final_message=cont, tokenize=True,
                                      return_dict=False)
        assert got == ids, (i, gen, tok.decode(got), tok.decode(ids))
    got = tok.apply_chat_template(CONTINUED, continue_final_message=True, tokenize=True,
                                  return_dict=False)
    assert got == kvlab_ids[-1]
    assert tok.decode(got).endswith("assistant: The lamplighter of")


def test_vllm_renders_the_servers_token_ids(kvlab_ids):
    """``vllm serve kvlab-tiny`` (no ``--chat-template``) renders these ids: vLLM's renderer
    with the template from kvlab-tiny's tokenizer_config.json."""
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM 0.32 is not installed in .venv-vllm")
    job = {"chat": [{"messages": CORPUS[i], "add_generation_prompt": gen,
                     "continue_final_message": cont} for i, gen, cont in CASES]
           + [{"messages": CONTINUED, "add_generation_prompt": False,
               "continue_final_message": True}]}
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_oracle.py"),
                          str(shipped_model_path(MODEL))], input=json.dumps(job),
                         capture_output=True, text=True, timeout=1200, cwd="/tmp",
                         env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PATH": "/usr/bin:/bin",
                              "VLLM_LOGGING_LEVEL": "ERROR", "HOME": "/tmp"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["chat"] == kvlab_ids


def test_the_template_is_whitespace_safe_and_writes_the_bos():
    """Rendered with and without ``trim_blocks`` / ``lstrip_blocks`` the text is the same, it
    starts with the BOS, and turns are separated by newlines (the two causes of the old
    32-vs-35-token mismatch)."""
    jinja2 = pytest.importorskip("jinja2")
    engine_template = ChatTemplate(KVLAB_CHAT_TEMPLATE, {"bos_token": "<|bos|>"})
    for messages in CORPUS:
        conv, _ = conversation(messages)
        want = engine_template.render(conv)
        for env in (jinja2.Environment(), jinja2.Environment(trim_blocks=True,
                                                             lstrip_blocks=True)):
            env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
            got = env.from_string(KVLAB_CHAT_TEMPLATE).render(
                messages=conv, add_generation_prompt=True, bos_token="<|bos|>",
                raise_exception=None)
            assert got == want
        assert want.startswith("<|bos|>") and want.endswith("\nassistant:")
        assert want.count("\n") >= len(messages)
    assert engine_template.render(conversation(CORPUS[0])[0]) == "<|bos|>user: hi\nassistant:"


def test_template_kwargs_reach_a_template_that_reads_them(tmp_path):
    """``chat_template_kwargs`` are template variables (vLLM passes them to
    ``apply_chat_template``); a checkpoint's own template is the one rendered."""
    source = ("{{ bos_token }}{% if greeting is defined %}{{ greeting + ' ' }}{% endif %}"
              "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    model = tmp_path / "m"
    model.mkdir()
    src = shipped_model_path(MODEL)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        (model / name).symlink_to(src / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config,
                                                             "chat_template": source}))
    engine = LLMEngine(EngineArgs(str(model), max_model_len=64))
    template = chat_template(engine)
    assert template.source == source and "greeting" in template.variables
    conv, _ = conversation([{"role": "user", "content": "lamps"}])
    assert template.render(conv, kwargs={"greeting": "Hello"}) == "<|bos|>Hello lamps"
    with ServerThread(build_app(AsyncEngine(engine, model_name="m"), "m")) as srv:
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "lamps"}], "max_tokens": 1,
            "chat_template_kwargs": {"greeting": "Hello", "unused": 1}})
        assert resp.status_code == 200
        assert resp.headers["x-kvlab-ignored-fields"] == "chat_template_kwargs.unused"
        tokens = httpx.post(srv.url + "/tokenize", timeout=60, json={
            "messages": [{"role": "user", "content": "lamps"}],
            "chat_template_kwargs": {"greeting": "Hello"}}).json()["tokens"]
        assert engine.tokenizer.decode(tokens, skip_special_tokens=False) == \
            "<|bos|>Hello lamps"
        assert resp.json()["usage"]["prompt_tokens"] == len(tokens)
