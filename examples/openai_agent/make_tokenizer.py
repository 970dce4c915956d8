"""Builds the example's tokenizer (``tokenizer/`` beside this file), offline, with `tokenizers`
and `transformers`: a word-level tokenizer over the words of the guessing game, with a chat
template in Qwen3's format (``<|im_start|>`` turns, tools in the system turn, tool calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tool results as
``<tool_response>`` user turns).

Its vocabulary holds each whole tool call of the game as ONE token (an added token that is
not special, as Qwen's ``<tool_call>``), so a model trained from a random init for a few
minutes on a CPU can learn to call the tools; the text of a call is still Qwen3's hermes
format, parsed by the engine's tool-call parser like any model's. Words outside the
vocabulary encode as ``<unk>``.

    python examples/openai_agent/make_tokenizer.py [OUT_DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = [" ", "\n", "system", "user", "assistant", "tools:", "compare", "answer", "guess", "to", "higher", "lower",
         "equal", "right", "wrong", "error", "<tool_response>", "</tool_response>"] + [str(d) for d in range(10)]
TOOLS = ("compare", "answer")
NUMBERS = range(4)
VOCAB_SIZE = 48  # padded with <extra_i> tokens: the model's vocab_size

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for t in tools %}{{- ' ' + (t.function.name if t.function is defined else t.name) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{%- set f = c.function if c.function is defined else c %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def call_text(name: str, n: int) -> str:
    """A tool call of the game as the chat template writes it (Qwen3's format)."""
    return '<tool_call>\n{"name": "%s", "arguments": {"n": %d}}\n</tool_call>' % (name, n)


def build(out: str | Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    calls = [call_text(t, n) for t in TOOLS for n in NUMBERS]
    extra = [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(SPECIAL) - len(WORDS) - len(calls))]
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + extra)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words between single spaces and newlines, which are tokens too: decoding is concatenation
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"),
                                                pre_tokenizers.Split("\n", "isolated")])
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<tool_response>", "</tool_response>"] + calls])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    cfg_file = out / "tokenizer_config.json"  # the class name transformers 4 and 5 both resolve
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"},
                                   indent=2) + "\n")
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}, indent=2) + "\n")
    assert len(tok) == VOCAB_SIZE, len(tok)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "tokenizer"))
