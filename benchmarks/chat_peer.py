"""Chats rendered by pagefleet against vLLM's CPU build: the same prompt token ids for every chat, template and
chat_template_kwargs below, or both refuse it.

    make check-peer-chat                 # or: python benchmarks/chat_peer.py

vLLM's side is `LLM.chat(messages, chat_template=T, chat_template_kwargs=K)` (its offline chat path, which its
OpenAI server and `run-batch` share); pagefleet's is `orchestrator.plan.chat` (`parse_messages`, `render_chat`),
then the tokenizer without special tokens, as planning and `generate` encode a chat. Both load the `llama-40m`
preset's tokenizer. The templates are of the shapes vLLM tells apart: content read as a string, content looped over
as parts (directly, through a `set` alias with a slice, a macro parameter, a `content` variable), a template that
names the developer role, and one that reads `enable_thinking`, `documents` and `tools`. The chats cover every text
part type, null parts, tool calls with good, bad and non-object arguments, tool results as parts, reasoning, names,
developer messages in and out of place. vLLM is installed as for benchmarks/peer_bench.py (`.peer/vllm-venv`); the
model lives under `.peer/work/chat-<pid>` while the check runs.
Prints each case that differs and exits 1 when any does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import PEER, ROOT, VENV, ensure_vllm_venv, vllm_env  # noqa: E402 - one vLLM install for both

END = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
EXTRAS = ("{% if m.name is defined %}[name={{ m.name }}]{% endif %}{% if m.tool_calls is defined %}"
          "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }};{% endfor %}"
          "{% endif %}{% if m.reasoning_content is defined %}R:{{ m.reasoning_content }}{% endif %}"
          "{% if m.tool_call_id is defined %}ID:{{ m.tool_call_id }}{% endif %}")
PARTS = "{% for p in m.content %}<{{ p.text }}>{% endfor %}"
TEMPLATES = {
    "string": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}" + EXTRAS + "<|end|>\n"
              "{% endfor %}" + END,
    "names_developer": "{% for m in messages %}{% if m.role == 'developer' %}DEV {% endif %}<|{{ m.role }}|>\n"
                       "{{ m.content }}<|end|>\n{% endfor %}" + END,
    "parts": "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}S{{ m['content'] | trim }}"
             "{% else %}" + PARTS + "{% endif %}<|end|>\n{% endfor %}" + END,
    "slice_alias": "{% set rest = messages[1:] %}{{ messages[0].content if messages[0].content is string else 'L' }}"
                   "{% for m in rest %}<|{{ m.role }}|>\n{% if m.content is string %}{{ m.content }}{% else %}"
                   "{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text | trim }}+"
                   "{% endfor %}{% endif %}<|end|>\n{% endfor %}" + END,
    "macro": "{% macro r(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}[{{ p.text }}]{% endfor %}"
             "{% endif %}{% endmacro %}{% for m in messages %}<|{{ m.role }}|>\n{{ r(m.content) }}<|end|>\n"
             "{% endfor %}" + END,
    "content_variable": "{% for m in messages %}{% set content = m.content %}<|{{ m.role }}|>\n{% if content is "
                        "string %}{{ content }}{% else %}{% for p in content %}<{{ p.text }}>{% endfor %}{% endif %}"
                        "<|end|>\n{% endfor %}" + END,
    "thinking": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n"
                "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                "{% if documents %}{{ documents | length }} docs{% endif %}{% if tools %}T{{ tools | length }}"
                "{% endif %}",
}


def text(t):
    return {"type": "text", "text": t}


CHATS = {
    "plain": [{"role": "user", "content": "  Write two sentences about the sea.  "}],
    "parts": [{"role": "system", "content": [text("You are"), text("terse.")]},
              {"role": "user", "content": [text("first"), text(" second "), "bare"]}],
    "part_kinds": [{"role": "user", "content": [
        text("a"), text(None), {"type": "refusal", "refusal": "no"}, {"type": "input_text", "text": "it"},
        {"type": "output_text", "text": "ot"}, {"type": "thinking", "thinking": "hm"}]}],
    "tools": [{"role": "user", "content": "weather?", "name": "bob"},
              {"role": "assistant", "content": None, "reasoning": "think", "tool_calls": [
                  {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}},
                  {"id": "c2", "type": "function", "function": {"name": "bad", "arguments": "{not json"}},
                  {"id": "c3", "type": "function", "function": {"name": "list", "arguments": "[1, 2]"}},
                  {"id": "c4", "type": "function", "function": {"name": "none"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": [text("sunny"), text("12C")]},
              {"role": "assistant", "content": "ok", "tool_calls": []}, {"role": "user", "content": "thanks"}],
    "developer": [{"role": "system", "content": "S1"}, {"role": "user", "content": "u1"},
                  {"role": "developer", "content": [text("D1"), text("D2")]}, {"role": "system", "content": ""},
                  {"role": "user", "content": "u2"}],
    "developer_first": [{"role": "developer", "content": "Dev"}, {"role": "user", "content": "u"}],
}
KWARGS = {"none": None, "off": {"enable_thinking": False},
          "mixed": {"enable_thinking": False, "documents": [{"a": 1}], "unread": 1, "add_generation_prompt": False},
          "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}}


def cases() -> list[tuple[str, str, dict, dict | None]]:
    return [(f"{t}/{c}/{k}", template, chat, kwargs) for t, template in TEMPLATES.items() for c, chat in CHATS.items()
            for k, kwargs in KWARGS.items() if k == "none" or t == "thinking"]


def vllm_worker(model: str, output: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048)
    out = {}
    for name, template, chat, kwargs in cases():
        try:
            (o,) = llm.chat(chat, SamplingParams(max_tokens=1), chat_template=template, chat_template_kwargs=kwargs,
                            use_tqdm=False)
            out[name] = list(o.prompt_token_ids)
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            out[name] = f"refused: {type(e).__name__}: {e}"
    Path(output).write_text(json.dumps(out))


def pagefleet_side(model: str) -> dict:
    from transformers import AutoTokenizer

    from orchestrator.plan.chat import parse_messages, render_chat
    from orchestrator.plan.rejection import Rejection

    tokenizer, out = AutoTokenizer.from_pretrained(model), {}
    for name, template, chat, kwargs in cases():
        tokenizer.chat_template = template
        messages = parse_messages(json.loads(json.dumps(chat)), "messages")
        rendered = messages if isinstance(messages, Rejection) else render_chat(tokenizer, messages, model,
                                                                               kwargs=kwargs)
        out[name] = f"refused: {rendered.reason}: {rendered.detail}" if isinstance(rendered, Rejection) else \
            tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-worker", nargs=2, metavar=("MODEL", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    ensure_vllm_venv()
    work, scratch = PEER / "work" / f"chat-{os.getpid()}", PEER / "scratch"
    model = work / "llama-40m"
    subprocess.run([sys.executable, "-m", "orchestrator", "init-model", "--preset", "llama-40m", "--output",
                    str(model)], cwd=ROOT, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    subprocess.run([str(VENV / "bin" / "python"), __file__, "--vllm-worker", str(model), str(work / "vllm.json")],
                   check=True, env=vllm_env(scratch), cwd=work)
    theirs, ours = json.loads((work / "vllm.json").read_text()), pagefleet_side(str(model))
    shutil.rmtree(work)  # a 160 MB model an invocation; the differences are printed
    differ = [name for name in ours if ours[name] != theirs[name] and not (
        isinstance(ours[name], str) and isinstance(theirs[name], str))]
    for name in differ:
        print(f"DIFFERS {name}\n  pagefleet: {ours[name]}\n  vLLM:      {theirs[name]}")
    refused = sum(isinstance(ours[name], str) and isinstance(theirs[name], str) for name in ours)
    print(f"{len(ours) - len(differ) - refused} of {len(ours)} chats: the same prompt token ids; {refused} refused by "
          f"both; {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
