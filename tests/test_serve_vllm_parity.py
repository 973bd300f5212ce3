"""kvlab serve where it meets vLLM 0.32's behaviour: what each request field does, max_tokens,
min_tokens and stop strings, n above max_num_seqs, per-sample latency metrics, logprob token
names, /metrics labels, get_metrics, bench's --input-len, a lone surrogate.

Each test names the vLLM 0.32 file and function whose behaviour it checks. Where vLLM itself is
installed (``.venv-vllm``, as on the maintainers' machines; not in CI), ``oracle`` runs vLLM's
own code (``tests/vllm_oracle.py``) on the same inputs and the test compares kvlab's answer
with vLLM's; the rest of each test holds without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from test_serve_api import idle, sse, wait_until

from kvlab import LLM, SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.bench import length_dist
from kvlab.entrypoints.openai_protocol import (
    CHAT_FIELDS,
    CHAT_REFUSED,
    COMPLETION_FIELDS,
    REFUSED,
)
from kvlab.entrypoints.openai_responses import TokenNames
from kvlab.entrypoints.prometheus import parse_metrics
from kvlab.entrypoints.serve import IGNORED_HEADER, build_app
from kvlab.entrypoints.uvicorn_server import ServerThread
from kvlab.models import shipped_model_path
from kvlab.sim.workload import fixed

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "kvlab-tiny"
CONTEXT = 256
PROMPT = "The lamplighter of Vale"      # greedy, ignore_eos: <|eos|><|bos|> at tokens 82, 83

#: what vllm-router 0.1.17 adds to the bodies it forwards (captured from its requests)
ROUTER_COMPLETION = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=CONTEXT))      # max_num_seqs: 64
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def greedy(server):
    """The greedy continuation of PROMPT (90 tokens, EOS ignored), as the server runs it."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 90, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    got = post(server, "/v1/completions", body).json()
    ref = LLM(MODEL, max_model_len=CONTEXT).generate(
        [PROMPT], SamplingParams(max_tokens=90, temperature=0, ignore_eos=True),
        use_tqdm=False)[0]
    assert got["choices"][0]["text"] == ref.outputs[0].text
    return ref.prompt_token_ids, ref.outputs[0].token_ids


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=300)


def metrics(server) -> dict:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)


def series(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))),
                 0.0)


# ---------------------------------------------------------------- vLLM's own answers

TEXT_CASES = [   # (stop, min_tokens, include, skip_special_tokens, stop token at)
    (["Vale", "river"], 0, False, True, None),
    (["Vale", "river"], 0, True, True, None),
    (["Vale"], 12, False, True, None),          # the first "Vale" is held back by min_tokens
    (["Vale"], 12, True, True, None),
    ([], 0, False, False, None),                # <|eos|><|bos|> in the text
    ([], 0, False, True, 15),                   # a stop token: its text left out ...
    ([], 0, True, True, 15),                    # ... unless include_stop_str_in_output
]


@pytest.fixture(scope="module")
def oracle(greedy):
    """vLLM 0.32's answers (tests/vllm_oracle.py) for this module's inputs; skipped without
    vLLM's interpreter."""
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM 0.32 is not installed in .venv-vllm (the comparisons with vLLM's own "
                    "code run where it is; the behaviour checks below run everywhere)")
    prompt_ids, ids = greedy
    tok = LLM(MODEL, max_model_len=CONTEXT).tokenizer
    split = tok.encode("中文😀 the river 漢", add_special_tokens=False)
    job = {
        "bodies": [["completion", {"prompt": "hi", **ROUTER_COMPLETION}],
                   ["chat", {"messages": [{"role": "user", "content": "hi"}], **ROUTER_CHAT}],
                   ["completion", {"prompt": "hi", "max_tokens": None}],
                   ["completion", {"prompt": "hi", "min_p": 0.2, "store": True,
                                   "skip_special_tokens": False,
                                   "include_stop_str_in_output": True,
                                   "spaces_between_special_tokens": False}],
                   ["chat", {"messages": [{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": None,
                                           "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f",
                                                                        "arguments": "{}"}}]},
                                          {"role": "tool", "tool_call_id": "c", "content": "1"}],
                             "store": True, "parallel_tool_calls": False,
                             "chat_template_kwargs": {"x": 1}, "add_generation_prompt": True}]],
        "max_tokens": [[CONTEXT, 3, CONTEXT - 2], [CONTEXT, 16, 10], [CONTEXT, None, 10],
                       [CONTEXT, CONTEXT + 1, 10], [2048, 3, 2046]],
        "names": [[split, [[0, 1, t] for t in split]], [ids[:20], [[0, 1]] * 20]],
        "bos": 0,
        "text": [{"prompt": list(prompt_ids), "ids": _case_ids(ids, at), "stop": stop,
                  "min_tokens": least, "include": include, "skip_special_tokens": skip,
                  "stop_terminated": at is not None}
                 for stop, least, include, skip, at in TEXT_CASES],
    }
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_oracle.py"),
                          str(shipped_model_path(MODEL))], input=json.dumps(job),
                         capture_output=True, text=True, timeout=1200, cwd="/tmp",
                         env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PATH": "/usr/bin:/bin",
                              "VLLM_LOGGING_LEVEL": "ERROR", "HOME": "/tmp"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    out["split"] = split
    return out


def _case_ids(ids: list[int], stop_at: int | None) -> list[int]:
    return list(ids) if stop_at is None else list(ids[:ids.index(ids[stop_at]) + 1])


def test_field_tables_are_vllms(oracle):
    """kvlab honours or refuses only fields vLLM 0.32's request models define
    (``CompletionRequest`` / ``ChatCompletionRequest``), save the documented exceptions, and
    vLLM validates the bodies vllm-router sends, extra fields and all (``OpenAIBaseModel``:
    ``extra="allow"``, ``vllm/entrypoints/serve/engine/protocol.py``)."""
    f = oracle["fields"]
    removed = {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}  # vLLM: gone
    assert COMPLETION_FIELDS - set(f["completion"]) == removed | {"no_stop_trim"}
    assert CHAT_FIELDS - set(f["chat"]) == removed | {"no_stop_trim"}
    assert set(REFUSED) - set(f["completion"]) == {"best_of"}   # vLLM drops it unread
    assert set(CHAT_REFUSED) - set(f["chat"]) == {"best_of"}
    router, router_chat, null_max, sampling, tools = f["bodies"]
    assert router["ok"] and router_chat["ok"] and tools["ok"]
    assert null_max["max_tokens"] == 16                         # normalize_null_max_tokens
    assert sampling["min_p"] == 0.2 and sampling["skip_special_tokens"] is False
    assert sampling["include_stop_str_in_output"] is True


def test_router_and_unknown_fields_are_ignored_and_named(server):
    """vLLM answers 200 to fields it does not use (it logs them); kvlab too, and names them in
    the x-kvlab-ignored-fields header. The answer is the one without them."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    plain = post(server, "/v1/completions", base)
    extra = post(server, "/v1/completions", {**base, **ROUTER_COMPLETION, "store": True,
                                              "metadata": {"a": "b"}, "stream_interval": 4})
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert extra.headers[IGNORED_HEADER] == "metadata, return_hidden_states, store, " \
                                            "stream_interval"
    assert IGNORED_HEADER not in plain.headers
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Where is Vale?"},
                {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "lookup", "arguments": '{"place": "Vale"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "north of the river"}]
    chat = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 4, **ROUTER_CHAT,
        "tools": [{"type": "function", "function": {"name": "lookup"}}], "tool_choice": "none",
        "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.status_code == 200, chat.text
    assert chat.headers[IGNORED_HEADER] == (
        "chat_template_kwargs.enable_thinking, include_reasoning, messages[].refusal, "
        "parallel_tool_calls, return_hidden_states, separate_reasoning, stream_reasoning, "
        "tool_choice, tools")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**base, "stream": True, "store": True}) as resp:
        assert resp.headers[IGNORED_HEADER] == "store" and sse(resp)


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("completions", {"logit_bias": {"5": 3}}, "logit_bias"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("completions", {"priority": 2}, "priority"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(server, route, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if route == "chat"
                else {"prompt": "hi"})
    resp = post(server, f"/v1/{'chat/' if route == 'chat' else ''}completions",
                {**base, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and param in resp.json()["error"]["message"]
    off = {"logit_bias": {}, "best_of": 1, "use_beam_search": False, "prompt_logprobs": None,
           "suffix": "", "truncate_prompt_tokens": None, "priority": 0, "tool_choice": "none",
           "echo": False, "chat_template": None, "continue_final_message": False,
           "stream_options": None}[param]
    assert post(server, f"/v1/{'chat/' if route == 'chat' else ''}completions",
                {**base, **{k: v for k, v in extra.items() if k != param},
                 param: off}).status_code == 200


# ---------------------------------------------------------------- honoured fields

def test_min_p_over_http(server):
    """``min_p`` reaches the sampler (vLLM: ``MinPLogitsProcessor``): at 1 only the most likely
    token survives, so a seeded sample is the greedy text; out of range it is a 400."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}
    greedy_text = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    sampled = post(server, "/v1/completions", {**body, "temperature": 3.0, "seed": 2,
                                               "min_p": 1.0}).json()
    free = post(server, "/v1/completions", {**body, "temperature": 3.0, "seed": 2}).json()
    assert sampled["choices"][0]["text"] == greedy_text["choices"][0]["text"] \
        != free["choices"][0]["text"]
    bad = post(server, "/v1/completions", {**body, "min_p": 1.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"


def test_text_options_stop_strings_and_min_tokens_are_vllms(server, greedy, oracle):
    """The answer's text for stop strings, ``min_tokens``, ``include_stop_str_in_output``,
    ``skip_special_tokens`` and a stop token equals vLLM's detokenizer on the same tokens
    (``BaseIncrementalDetokenizer.update``, ``vllm/v1/engine/detokenizer.py``: stop strings are
    looked for only past ``min_tokens`` tokens; a stop-terminated sample's last token is left
    out of the text unless ``include_stop_str_in_output``)."""
    _, ids = greedy
    for (stop, least, include, skip, at), (want, want_stop) in zip(TEXT_CASES, oracle["text"],
                                                                  strict=True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 90, "temperature": 0,
                "ignore_eos": True, "stop": stop, "min_tokens": least,
                "include_stop_str_in_output": include, "skip_special_tokens": skip}
        if at is not None:
            body["stop_token_ids"] = [ids[at]]
        c = post(server, "/v1/completions", body).json()["choices"][0]
        assert c["text"] == want, (stop, least, include, skip, at)
        assert c["stop_reason"] == (want_stop if want_stop else
                                    ids[at] if at is not None else None)
        streamed = post(server, "/v1/completions", {**body, "stream": True}).text
        chunks = [json.loads(line[5:]) for line in streamed.splitlines()
                  if line.startswith("data: {")]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == want


def test_min_tokens_holds_back_a_stop_string(server, greedy):
    """The issue's case: a stop string in the first tokens no longer ends the answer while
    ``min_tokens`` is not reached (vLLM 0.32: only text past ``min_tokens`` tokens is
    searched)."""
    _, ids = greedy
    tok = server.engine.tokenizer
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stop": [" town"]}
    early = post(server, "/v1/completions", body).json()
    held = post(server, "/v1/completions", {**body, "min_tokens": 17}).json()
    assert tok.decode(ids[6:7]) == " town"
    assert early["usage"]["completion_tokens"] == 7 and early["choices"][0]["text"] == \
        tok.decode(ids[:6])
    assert held["usage"]["completion_tokens"] >= 17
    assert held["choices"][0]["text"].startswith(tok.decode(ids[:17]))


def test_continue_final_message_and_chat_template_kwargs(server):
    """``continue_final_message`` renders the last turn open (vLLM/transformers cut the text
    after its content), so the prompt is the one ``/tokenize`` gives for it; a kwarg the
    template does not read is named as ignored."""
    messages = [{"role": "user", "content": "Who lit the lamps?"},
                {"role": "assistant", "content": "The lamplighter"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    got = post(server, "/v1/chat/completions", body)
    ids = post(server, "/tokenize", {"model": MODEL, "messages": messages,
                                     "add_generation_prompt": False,
                                     "continue_final_message": True}).json()["tokens"]
    tok = server.engine.tokenizer
    assert tok.decode(ids).endswith("assistant: The lamplighter")
    assert got.json()["usage"]["prompt_tokens"] == len(ids)
    assert got.headers[IGNORED_HEADER] == "chat_template_kwargs.enable_thinking"


def test_cache_salt_separates_prefix_caches(server):
    """``cache_salt`` (vLLM: salts the prefix-cache hashes) maps to a prefix-cache domain:
    the same prompt under another salt finds nothing cached, under the same salt it does."""
    prompt = " ".join(["the lamps of Vale were lit at dusk"] * 8)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def hits(extra: dict) -> float:
        before = series(metrics(server), "vllm:prefix_cache_hits_total")
        assert post(server, "/v1/completions", {**body, **extra}).status_code == 200
        wait_until(lambda: idle(server.engine))
        return series(metrics(server), "vllm:prefix_cache_hits_total") - before

    hits({"cache_salt": "tenant-a"})
    assert hits({"cache_salt": "tenant-b"}) == 0
    assert hits({"cache_salt": "tenant-a"}) > 0
    bad = post(server, "/v1/completions", {**body, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


# ---------------------------------------------------------------- max_tokens

def test_max_tokens_is_clamped_defaulted_and_bounded_as_in_vllm(server, oracle):
    """``get_max_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``): the smaller of the
    request's value and what fits; above the context length itself a 400
    (``TokenizeParams.__post_init__``, ``vllm/renderers/params.py``); completions' absent or
    null ``max_tokens`` is 16 (``CompletionRequest``), chat's is the checkpoint's
    ``generation_config.json`` ``max_new_tokens`` (128 for kvlab-tiny:
    ``ModelConfig.get_diff_sampling_param``)."""
    assert oracle["max_tokens"][:4] == [2, 16, CONTEXT - 10, oracle["max_tokens"][3]]
    assert oracle["max_tokens"][3].startswith("error: max_tokens=257 cannot be greater")
    assert oracle["max_tokens"][4] == 2          # the case: 2,046 ids + 3 -> 2
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    clamped = post(server, "/v1/completions", {**base, "prompt": [5] * (CONTEXT - 2),
                                               "max_tokens": 3}).json()
    assert clamped["usage"]["completion_tokens"] == 2
    assert clamped["choices"][0]["finish_reason"] == "length"
    for extra in ({}, {"max_tokens": None}):
        got = post(server, "/v1/completions", {**base, "prompt": "hi", **extra}).json()
        assert got["usage"]["completion_tokens"] == 16
    chat = post(server, "/v1/chat/completions", {**base, "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert chat["usage"]["completion_tokens"] == 128
    too_many = post(server, "/v1/completions", {**base, "prompt": "hi",
                                                "max_tokens": CONTEXT + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert "cannot be greater than max_model_len=256" in too_many.json()["error"]["message"]


# ---------------------------------------------------------------- n, metrics

def test_n_above_max_num_seqs_is_served(server):
    """vLLM fans ``n`` out into child requests the scheduler takes as they fit
    (``ParentRequest``, ``vllm/v1/engine/parallel_sampling.py``), so n = 65 with 64 sequences
    a step is served; kvlab's samples are scheduled the same way."""
    assert server.engine.args.max_num_seqs == 64
    got = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 65,
                                           "max_tokens": 2, "temperature": 1.0, "seed": 1,
                                           "ignore_eos": True}).json()
    assert len(got["choices"]) == 65 and got["usage"]["completion_tokens"] == 130
    assert sorted(c["index"] for c in got["choices"]) == list(range(65))
    wait_until(lambda: idle(server.engine))


def test_latency_metrics_count_each_sample_as_vllm_counts_child_requests(server):
    """``IterationStats.update_from_output`` (``vllm/v1/metrics/stats.py``) runs once per
    child request and step: n = 4 samples of 10 tokens give 4 TTFTs, 4 x 9 inter-token gaps
    (not 39 with 30 near zero), and 4 finished requests."""
    before = metrics(server)
    post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 10,
                                     "temperature": 1.0, "seed": 3, "ignore_eos": True})
    wait_until(lambda: idle(server.engine))
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return series(after, name, **labels) - series(before, name, **labels)

    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == 36
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:generation_tokens_total") == 40
    # each sample's gaps add up to at most its own latency
    assert delta("vllm:inter_token_latency_seconds_sum") \
        <= delta("vllm:e2e_request_latency_seconds_sum")


def test_metrics_carry_vllms_labels_and_not_its_retired_names(server):
    """vLLM 0.32 labels every series ``model_name`` and ``engine`` (``PrometheusStatLogger``,
    ``vllm/v1/metrics/loggers.py``) and no longer exports ``vllm:gpu_cache_usage_perc`` or
    ``vllm:time_per_output_token_seconds``."""
    m = metrics(server)
    names = {name for name, _ in m}
    assert not names & {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds",
                        "vllm:time_per_output_token_seconds_count"}
    assert "vllm:kv_cache_usage_perc" in names
    for (name, labels), _ in m.items():
        assert dict(labels)["engine"] == "0" and dict(labels)["model_name"] == MODEL, name


def test_get_metrics_has_the_model_name():
    """``LLM.get_metrics()`` labels as vLLM's reader does (``vllm/v1/metrics/reader.py``):
    ``model_name`` and ``engine``."""
    llm = LLM(MODEL, max_model_len=64)
    llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    for m in llm.get_metrics():
        assert m.labels["model_name"] == MODEL and m.labels["engine"] == "0"


# ---------------------------------------------------------------- names, surrogates, bench

def test_logprob_token_names_are_vllms(server, greedy, oracle):
    """A token's name in logprobs (``LogprobsProcessor._verify_tokens``,
    ``vllm/v1/engine/logprobs.py``): special tokens by name, and tokens that split a character
    '' except the one completing it; an echoed prompt's first token is ``decode(id)``, the
    BOS's name (``CompletionServing._create_completion_logprobs``)."""
    names = TokenNames(server.engine.tokenizer)
    _, ids = greedy
    split = oracle["split"]
    for sampled, want in zip([split, list(ids[:20])], oracle["names"], strict=True):
        alts = [[0, 1, t] for t in split] if sampled is split else [[0, 1]] * 20
        for j, t in enumerate(sampled):
            got = [names.text(x, tuple(sampled[max(0, j - 4):j])) for x in [t, *alts[j]]]
            assert got == want[j], (j, got, want[j])
    assert any(w[0] == "" for w in oracle["names"][0])      # the case did split characters
    echoed = post(server, "/v1/completions", {"model": MODEL, "prompt": "中文 the river",
                                              "max_tokens": 1, "echo": True, "logprobs": 0,
                                              "temperature": 0}).json()
    tokens = echoed["choices"][0]["logprobs"]["tokens"]
    assert tokens[0] == oracle["first_prompt_token"] == "<|bos|>"
    assert tokens[1:4] == ["", "", "中"]


def test_a_lone_surrogate_is_a_clear_400(server):
    """A lone surrogate is valid JSON text but not Unicode: the answer says so and names the
    field, instead of the tokenizer's "TextInputSequence must be str"."""
    for route, body, param in (
            ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\udfff"}]},
             "messages")):
        resp = post(server, route, {"model": MODEL, "max_tokens": 2, **body})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == param
        assert "lone surrogate" in err["message"] and "TextInputSequence" not in err["message"]


def test_bench_takes_a_plain_input_length():
    """``kvlab bench --input-len 64`` as ``vllm bench serve --input-len 64``: every prompt 64
    tokens."""
    import random

    rng = random.Random(0)
    assert [length_dist("64")(rng) for _ in range(5)] == [fixed(64)(rng) for _ in range(5)] \
        == [64] * 5
    assert length_dist(" 64 ")(rng) == length_dist("fixed:64")(rng) == 64
    with pytest.raises(ValueError, match="expected N, fixed:N"):
        length_dist("sixty")
