"""vLLM 0.32's own answers to the questions tests/test_serve_vllm_parity.py asks kvlab.

Run with vLLM's interpreter (``.venv-vllm/bin/python tests/vllm_oracle.py MODEL_DIR``): reads a
JSON job on stdin, writes JSON answers on stdout. Every answer comes from vLLM's code, called
the way its OpenAI server calls it (no engine, no model weights):

- ``fields``: the field names of ``CompletionRequest`` / ``ChatCompletionRequest``
  (``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``), and for each body
  whether the model validates it (extra fields are allowed) and the ``SamplingParams`` it makes;
- ``chat``: the prompt token ids ``vllm serve`` renders for a chat body with the checkpoint's
  own ``chat_template`` (``HfRenderer.render_messages``, ``vllm/renderers/hf.py``);
- ``max_tokens``: ``get_max_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``) and the
  ``TokenizeParams`` check (``vllm/renderers/params.py``) for (context, max_tokens, prompt);
- ``names``: logprob token names (``LogprobsProcessor``, ``vllm/v1/engine/logprobs.py``);
- ``text``: a sample's output text and stop string from vLLM's incremental detokenizer
  (``FastIncrementalDetokenizer.update``, ``vllm/v1/engine/detokenizer.py``).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main() -> None:
    model_dir = sys.argv[1]
    job = json.load(sys.stdin)

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.renderers.params import TokenizeParams
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor

    tok = get_tokenizer(model_dir)
    out: dict = {}

    out["fields"] = {"completion": sorted(CompletionRequest.model_fields),
                     "chat": sorted(ChatCompletionRequest.model_fields), "bodies": []}
    for route, body in job.get("bodies", []):
        cls = ChatCompletionRequest if route == "chat" else CompletionRequest
        try:
            req = cls(**body)
        except Exception as err:              # a validation error: vLLM answers 400
            out["fields"]["bodies"].append({"ok": False, "error": str(err)[:300]})
            continue
        params = req.to_sampling_params(16, {})
        out["fields"]["bodies"].append({"ok": True, "max_tokens": req.max_tokens, **{
            k: getattr(params, k) for k in ("min_p", "skip_special_tokens",
                                            "spaces_between_special_tokens",
                                            "include_stop_str_in_output", "min_tokens")}})

    if job.get("chat"):
        from vllm.config import ModelConfig
        from vllm.renderers.chat_utils import parse_chat_messages
        from vllm.renderers.hf import (
            resolve_chat_template_content_format,
            safe_apply_chat_template,
        )

        mc = ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=2048)
        out["chat"] = []
        for body in job["chat"]:
            req = ChatCompletionRequest(model="m", **body)
            params = req.build_chat_params(None, "auto")
            fmt = resolve_chat_template_content_format(
                chat_template=params.chat_template, tools=None,
                given_format=params.chat_template_content_format, tokenizer=tok,
                model_config=mc)
            conversation, _, _ = parse_chat_messages(req.messages, mc, content_format=fmt)
            out["chat"].append(safe_apply_chat_template(
                mc, tok, conversation, **params.get_apply_chat_template_kwargs()))

    out["max_tokens"] = []
    for max_model_len, max_tokens, prompt_len in job.get("max_tokens", []):
        try:
            TokenizeParams(max_total_tokens=max_model_len, max_output_tokens=max_tokens or 0,
                           max_output_tokens_param="max_tokens")
            out["max_tokens"].append(get_max_tokens(max_model_len, max_tokens, prompt_len, {}))
        except Exception as err:
            out["max_tokens"].append(f"error: {err}")

    names = LogprobsProcessor.__new__(LogprobsProcessor)
    names.tokenizer = tok
    out["names"] = []
    for sampled, alternatives in job.get("names", []):
        seq = []
        for j, t in enumerate(sampled):
            ids = [t, *alternatives[j]]
            decoded = convert_ids_list_to_tokens(tok, ids)
            seq.append(names._verify_tokens(decoded, ids, sampled[max(0, j - 4):j]))
        out["names"].append(seq)
    out["first_prompt_token"] = tok.decode(job.get("bos", 0))

    out["text"] = []
    for case in job.get("text", []):
        params = SamplingParams(max_tokens=len(case["ids"]), stop=case["stop"] or None,
                                min_tokens=case["min_tokens"],
                                include_stop_str_in_output=case["include"],
                                skip_special_tokens=case["skip_special_tokens"])
        request = SimpleNamespace(sampling_params=params, prompt_token_ids=case["prompt"],
                                  request_id="r")
        detok = FastIncrementalDetokenizer(tok, request)
        stop = None
        for j, t in enumerate(case["ids"]):
            last = j == len(case["ids"]) - 1
            stop = detok.update([t], last and case["stop_terminated"])
            if stop:
                break
        out["text"].append([detok.get_next_output_text(True, False), stop])

    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
