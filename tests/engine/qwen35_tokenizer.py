"""A tokenizer that writes Qwen3.5's tool-call form, for serving tests: the OpenAI-agent
example's word-level vocabulary, its eight whole-call tokens (compare / answer with n = 0..3)
rewritten in the XML form, and a chat template that renders tools, tool calls and tool results
as Qwen3.5's released template does (its system turn's ``# Tools`` block with one JSON line
per tool, ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>
\\n</tool_call>`` after the assistant's content, a value as ``tojson`` for a mapping or list
and as a string otherwise, consecutive tool results in one user turn of ``\\n<tool_response>
\\n...\\n</tool_response>`` blocks). The released template's thinking blocks and the instructions
in its tool block are left out: the vocabulary has no words for them, and the tool-call form
does not depend on them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.engine.openai_server import EXAMPLE


def xml_call(name: str, args: dict) -> str:
    """A call as the template writes it (and as the model is taught to)."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{%- set f = c.function if c.function is defined else c %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- elif (m.content or '') | trim %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for k, v in (f.arguments | items) %}{{- '<parameter=' + k + '>\\n' }}"
    "{{- (v | tojson) if (v is mapping or (v is sequence and v is not string)) else (v | string) }}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer(dest: Path) -> Path:
    """The tokenizer directory (module docstring) under ``dest``."""
    shutil.copytree(EXAMPLE / "tokenizer", dest)
    spec = json.loads((dest / "tokenizer.json").read_text())
    for tok in spec["added_tokens"]:
        if tok["content"].startswith("<tool_call>"):
            call = json.loads(tok["content"][len("<tool_call>"):-len("</tool_call>")])
            tok["content"] = xml_call(call["name"], call["arguments"])
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    (dest / "chat_template.jinja").write_text(TEMPLATE)
    return dest
