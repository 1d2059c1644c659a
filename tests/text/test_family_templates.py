"""The Qwen3 and Gemma 3 chat templates with the MemPO protocol, on the real template strings
(Qwen3: tests/fixtures/qwen3_chat_template.jinja; Gemma 3: the one shipped for the converted
checkpoint, ``mempo_jax/model/templates/gemma3_chat_template.jinja``), against transformers'
own renderer (``render_jinja_template``).

Decisions under test: a checkpoint's template renders with ``enable_thinking=False``
(``PROTOCOL_TEMPLATE_VARIABLES``), so Qwen3's generation prompt closes its native reasoning
block and the sampled MemPO turn (``<mem>…</mem><think>…</think><action>``) follows it; Gemma 3
has no system role, and its template puts the system prompt at the head of the first user turn.
"""

import json
import pathlib

import pytest

from mempo_jax.model.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE_FILE
from mempo_jax.text.chat_template import ChatTemplate, observation_frame, question_messages
from mempo_jax.text.protocol import parse_turn

QWEN3_TEMPLATE = (pathlib.Path(__file__).parents[1] / "fixtures" / "qwen3_chat_template.jinja").read_text("utf-8")
GEMMA3_TEMPLATE = GEMMA3_TEMPLATE_FILE.read_text("utf-8")
TURN = "<mem>Paris is in France.</mem><think>Search the river.</think><search>river of Paris</search>"


def _folder(tmp_path, template, special):
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(special))
    return ChatTemplate.from_checkpoint(tmp_path)


def _transformers(template, messages, gen, **kw):
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    rendered, _ = render(conversations=[messages], chat_template=template, add_generation_prompt=gen, **kw)
    return rendered[0]


def test_qwen3_prompt_closes_the_native_reasoning_block(tmp_path):
    template = _folder(tmp_path, QWEN3_TEMPLATE, {"eos_token": "<|im_end|>"})
    messages = question_messages("Which river flows through Paris?", "SYSTEM")
    text = template.render(messages, add_generation_prompt=True)
    assert text == _transformers(QWEN3_TEMPLATE, messages, True, enable_thinking=False)
    assert text == ("<|im_start|>system\nSYSTEM<|im_end|>\n<|im_start|>user\nWhich river flows through Paris?"
                    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # without the protocol's variables: exactly transformers' default (thinking on, nothing prefilled)
    plain = ChatTemplate(QWEN3_TEMPLATE).render(messages, add_generation_prompt=True)
    assert plain == _transformers(QWEN3_TEMPLATE, messages, True) and plain.endswith("<|im_start|>assistant\n")
    # the sampled turn follows the closed block; its own <think> is the protocol's, inside the turn
    parsed = parse_turn(TURN)
    assert (parsed.mem, parsed.think, parsed.action, parsed.argument) == (
        "Paris is in France.", "Search the river.", "search", "river of Paris")


def test_qwen3_would_strip_a_rendered_turn_so_contexts_stay_append_only(tmp_path):
    """Re-rendering a MemPO turn as a history message loses it: Qwen3's template cuts an
    assistant message at its last ``</think>`` (the reasoning dropped before the last user query).
    The agent never re-renders turns: contexts are prompt + sampled ids + observation frames."""
    template = _folder(tmp_path, QWEN3_TEMPLATE, {})
    history = question_messages("Q", "S") + [{"role": "assistant", "content": TURN}, {"role": "user", "content": "Q2"}]
    text = template.render(history)
    assert "<mem>" not in text and "<|im_start|>assistant\n<search>river of Paris</search><|im_end|>" in text


def test_qwen3_observation_frames_keep_the_reasoning_switch(tmp_path):
    template = _folder(tmp_path, QWEN3_TEMPLATE, {})
    assert observation_frame(template, "tool") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n<information>",
        "</information>\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert observation_frame(template, "user") == (
        "<|im_end|>\n<|im_start|>user\n<information>",
        "</information><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_gemma3_puts_the_system_prompt_into_the_first_user_turn(tmp_path):
    template = _folder(tmp_path, GEMMA3_TEMPLATE, {"bos_token": "<bos>", "eos_token": "<eos>"})
    messages = question_messages("Which river flows through Paris?", "SYSTEM PROMPT")
    text = template.render(messages, add_generation_prompt=True)
    assert text == _transformers(GEMMA3_TEMPLATE, messages, True, bos_token="<bos>", enable_thinking=False)
    assert text == ("<bos><start_of_turn>user\nSYSTEM PROMPT\n\nWhich river flows through Paris?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert "system" not in text  # no system role


def test_gemma3_observation_layouts(tmp_path):
    template = _folder(tmp_path, GEMMA3_TEMPLATE, {"bos_token": "<bos>"})
    assert observation_frame(template, "assistant") == ("<information>", "</information>")
    assert observation_frame(template, "user") == ("<end_of_turn>\n<start_of_turn>user\n<information>",
                                                   "</information><end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ValueError, match="tool_result_layout 'tool'.*alternate"):  # no tool role either
        observation_frame(template, "tool")
