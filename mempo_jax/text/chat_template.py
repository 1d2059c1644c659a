"""The prompt the model was trained for: chat templates, the MemPO system prompt, tool-result layouts.

* ``ChatTemplate`` — a checkpoint's own chat template (``chat_template.jinja`` or
  ``tokenizer_config.json``), rendered with jinja2 exactly as transformers renders it
  (``transformers/utils/chat_template_utils.py``: ``_compile_jinja_template`` and
  ``render_jinja_template``; ``tokenization_utils_base.py``: ``apply_chat_template``): an
  ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the
  ``loopcontrols`` extension, the ``raise_exception`` / ``strftime_now`` globals, a ``tojson``
  filter that does not HTML-escape, the ``{% generation %}`` block, and the named special tokens
  (``bos_token``, ``eos_token``, …) as variables. transformers is not imported (test-only).
* ``PlainTemplate`` — the from-scratch SentencePiece tokenizer's "template": the
  ``f"{SYSTEM_PROMPT}\\nQuestion: {question}\\n"`` prompt of ``AgentFormat.prompt_ids`` (BOS id first).
* ``encode_rendered`` — ids of a rendered string, special-token strings (``<|im_start|>``) as their
  ids, as ``apply_chat_template(tokenize=True)`` does (it encodes with ``add_special_tokens=False``).
* ``system_prompt`` — the MemPO protocol (``prompts/mempo_system.txt``, shipped with the package,
  overridable by a path), describing only the enabled tools.
* ``observation_frame`` / ``observation_text`` — the text appended after a sampled turn for a tool
  result, in the layout chosen by ``tool_result_layout``: ``"assistant"`` (the result continues the
  assistant's stream as ``<information>…</information>``; Search-R1 / ASearcher, the rollout's
  behaviour), ``"user"`` or ``"tool"`` (the result is a user / tool message of the template),
  derived by rendering the template.

Messages are ``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` dicts.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import os
import pathlib
import re
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from mempo_jax.text.protocol import ACCESS, ANSWER, INFORMATION, SEARCH
from mempo_jax.recipes import find_file

TOOL_RESULT_LAYOUTS: tuple[str, ...] = ("assistant", "user", "tool")
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"  # transformers' folder of named templates
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # legacy file; tokenizer_config.json wins
# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a
# template sees as variables (plus any other "*_token" string key and a dict extra_special_tokens).
SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases
# Template variables every checkpoint's template is rendered with by the agent
# (``ChatTemplate.from_checkpoint``): a template's own reasoning mode is off. The MemPO turn is
# ``<mem>…</mem>``, an optional ``<think>…</think>``, one action (docs/algorithm.md §1), so a
# template that opens a native reasoning block first (Qwen3 with ``enable_thinking`` true or
# unset) would put a ``<think>`` before the ``<mem>``. With it false, Qwen3's generation prompt
# ends with its closed, empty block ``<think>\n\n</think>\n\n`` and the sampled turn follows;
# the protocol's own ``<think>`` stays the policy's reasoning, inside the turn. Templates without
# the variable ignore it.
PROTOCOL_TEMPLATE_VARIABLES: Mapping[str, Any] = {"enable_thinking": False}

# The MemPO system prompt shipped with the package; ``{action_tags}`` and ``{actions}`` are filled in.
SYSTEM_PROMPT_FILE = "prompts/mempo_system.txt"
# One line per action, in this order; the tools (search, access) are listed only when enabled.
ACTION_DESCRIPTIONS: dict[str, str] = {
    "search": f"{SEARCH[0]} query {SEARCH[1]}: search the document collection; the best passages come back, "
              "one per line, as [doc ID] Title: text.",
    "access": f"{ACCESS[0]} doc ID {ACCESS[1]}: read the whole document with that ID (an ID shown as [doc ID] "
              "in the search results).",
    "answer": f"{ANSWER[0]} final answer {ANSWER[1]}: give the final answer as a short phrase, without "
              "explanation; this ends the episode.",
}
TOOLS: tuple[str, ...] = ("search", "access")

_TURN_SENTINEL = "MEMPOSAMPLEDTURN"  # stands for the sampled turn while deriving a layout
_EMPTY_REASONING = re.compile(r"\s*<think>\s*</think>\s*")  # a closed, empty native reasoning block
_OBS_SENTINEL = "MEMPOTOOLRESULT"  # stands for the tool result's body


# -- the jinja2 environment of transformers ------------------------------------------------------
class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: renders its body (transformers tracks the span for
    ``return_assistant_tokens_mask``; a plain render, as here, outputs the body unchanged)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own tojson HTML-escapes (<, >, &, ') and sorts keys
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` inside a template: calls and ``fromkeys`` only (transformers' ``TemplateDict``)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that rejects underscore attributes (transformers' ``TemplateNamespace``)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):  # serialised AddedToken
        return value["content"]
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """Template variables of a tokenizer config, as ``special_tokens_map`` gives them in transformers
    5: the named tokens, every other ``*_token`` key with a token value, a dict ``extra_special_tokens``."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if key in SPECIAL_TOKEN_NAMES or key.endswith("_token"):
            if (text := _token_text(value)) is not None:
                out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            if (text := _token_text(value)) is not None:
                out[str(key)] = text
    return out


def _normalize_messages(messages: Sequence[Mapping[str, Any]], source: str) -> list[dict]:
    """transformers' ``_normalize_chat_messages`` + ``_alias_reasoning_fields``: plain dict copies,
    keys whose value is None dropped, a reasoning field copied to ``reasoning_content``/``thinking``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"chat template {source}: messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"chat template {source}: cannot render an empty conversation")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"chat template {source}: message {i} is a {type(message).__name__}, not a dict")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# -- templates -----------------------------------------------------------------------------------
class ChatTemplate:
    """A Hugging Face chat template, rendered as ``transformers``' ``apply_chat_template`` does.

    Args:
      template: the jinja2 source.
      special_tokens: template variables such as ``{"bos_token": "<|im_start|>", …}`` (what
        transformers passes from ``tokenizer.special_tokens_map``).
      source: where the template came from (a file path), named in error messages.
      variables: template variables every ``render`` passes (its keyword arguments win), e.g.
        ``PROTOCOL_TEMPLATE_VARIABLES``; none by default (``render`` is then exactly
        ``apply_chat_template``).

    Raises:
      ValueError: the template does not compile (names ``source`` and the jinja2 message).

    Source: transformers 5.x ``utils/chat_template_utils.py`` (``_compile_jinja_template``,
    ``render_jinja_template``) and ``tokenization_utils_base.py`` (``apply_chat_template``,
    ``get_chat_template``).
    """

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None, source: str = "<string>",
                 variables: Mapping[str, Any] | None = None):
        if not isinstance(template, str) or not template:
            raise ValueError(f"chat template {source}: empty or not text")
        self.template = template
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self.variables = dict(variables or {})
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template {source} does not compile: {exc}") from None

    @classmethod
    def from_checkpoint(cls, folder: str | os.PathLike, name: str | None = None,
                        variables: Mapping[str, Any] | None = PROTOCOL_TEMPLATE_VARIABLES) -> "ChatTemplate":
        """Load the chat template of an HF checkpoint folder, with the priority transformers uses,
        rendered with ``variables`` (default ``PROTOCOL_TEMPLATE_VARIABLES``: the template's own
        reasoning mode off; None: none).

        1. ``chat_template.jinja`` (the default) and ``additional_chat_templates/NAME.jinja``; when
           any of these files exists, ``tokenizer_config.json``'s template is ignored.
        2. else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of
           ``{"name", "template"}`` (or a dict name → template).
        Of several templates, ``name`` (default ``"default"``) is taken. Special-token variables
        come from ``tokenizer_config.json`` (``special_tokens_map.json`` fills keys it lacks).

        Args:
          folder: the checkpoint folder.
          name: the named template to take; None takes the default one.

        Returns:
          The ChatTemplate; ``source`` names the file it came from.

        Raises:
          FileNotFoundError: ``folder`` is not a directory, or it holds no chat template at all.
          ValueError: a malformed ``tokenizer_config.json`` / ``chat_template`` field, or no
            template of that name (names the file and the available names).
        """
        folder = pathlib.Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder not found: {folder}")
        config: dict = {}
        config_path = folder / TOKENIZER_CONFIG
        for path in (folder / SPECIAL_TOKENS_MAP, config_path):
            if path.is_file():
                try:
                    data = json.loads(path.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as exc:
                    raise ValueError(f"{path}: not valid JSON ({exc})") from None
                if not isinstance(data, dict):
                    raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
                config.update(data)
        templates: dict[str, tuple[str, str]] = {}  # name -> (template, source)
        if (folder / TEMPLATE_FILE).is_file():
            templates["default"] = ((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE))
        if (folder / TEMPLATES_DIR).is_dir():
            for path in sorted((folder / TEMPLATES_DIR).glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = (path.read_text(encoding="utf-8"), str(path))
        if not templates and config_path.is_file() and config.get("chat_template") is not None:
            field = config["chat_template"]
            where = f"{config_path} field chat_template"
            if isinstance(field, str):
                templates["default"] = (field, where)
            elif isinstance(field, list):
                for i, entry in enumerate(field):
                    if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                            and isinstance(entry.get("template"), str)):
                        raise ValueError(f"{where}[{i}]: expected {{\"name\": str, \"template\": str}}")
                    templates[entry["name"]] = (entry["template"], f"{where}[{entry['name']!r}]")
            elif isinstance(field, Mapping) and all(isinstance(v, str) for v in field.values()):
                templates.update({str(k): (v, f"{where}[{k!r}]") for k, v in field.items()})
            else:
                raise ValueError(f"{where}: expected a string or a list of {{name, template}}, "
                                 f"got {type(field).__name__}")
        if not templates:
            raise FileNotFoundError(f"no chat template in {folder}: neither {TEMPLATE_FILE} nor a "
                                    f"chat_template field in {TOKENIZER_CONFIG}")
        want = name or "default"
        if want not in templates:
            raise ValueError(f"no chat template named {want!r} in {folder}; available: {sorted(templates)}")
        template, source = templates[want]
        return cls(template, _special_tokens(config), source, variables)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               **kwargs) -> str:
        """The template's text for ``messages`` (``apply_chat_template(..., tokenize=False)``).

        Args:
          messages: ``[{"role": …, "content": str}, …]``; keys with a None value are dropped first.
          add_generation_prompt: open an assistant turn at the end.
          **kwargs: further template variables (e.g. ``enable_thinking``); they override
            ``self.variables`` and the special tokens of the same name. ``tools`` and
            ``documents`` are None unless given.

        Returns:
          The rendered string (special tokens as text).

        Raises:
          ValueError: an empty conversation, a message that is not a dict, or the template raised
            (``raise_exception`` or a jinja2 error); names ``source``.
        """
        chat = _normalize_messages(messages, self.source)
        variables = {**self.special_tokens, **self.variables, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._compiled.render(messages=chat, add_generation_prompt=bool(add_generation_prompt),
                                         **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template {self.source}: {type(exc).__name__}: {exc}") from None

    def prompt_ids(self, tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                   **kwargs) -> list[int]:
        """``encode_rendered(tokenizer, render(messages, add_generation_prompt))``: the ids
        ``apply_chat_template(messages, add_generation_prompt, tokenize=True)`` gives. No BOS is
        prepended: a template that wants one writes ``{{ bos_token }}`` itself (Llama 3).

        Raises:
          ValueError: as ``render``.
        """
        return encode_rendered(tokenizer, self.render(messages, add_generation_prompt, **kwargs))

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r})"


@dataclasses.dataclass(frozen=True)
class PlainTemplate:
    """The from-scratch tokenizer's template: plain text, no roles, BOS id first.

    ``render`` writes a system message as ``"{content}\\n"``, a user message as
    ``"Question: {content}\\n"``, an assistant message verbatim (the sampled stream) and a tool
    message as ``"<information>{content}</information>"``; ``add_generation_prompt`` adds nothing.
    So ``[system SYSTEM_PROMPT, user question]`` renders ``AgentFormat.prompt_ids``' text
    ``f"{SYSTEM_PROMPT}\\nQuestion: {question}\\n"`` and ``prompt_ids`` gives its ids bitwise.
    """

    source: str = "plain"

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               **kwargs) -> str:
        """Plain text of ``messages`` (see the class docstring); ``kwargs`` are ignored.

        Raises:
          ValueError: an empty conversation, a message that is not a dict, a missing or non-string
            ``content``, or a role outside system/user/assistant/tool (names the message index).
        """
        parts = []
        for i, m in enumerate(_normalize_messages(messages, self.source)):
            role, content = m.get("role"), m.get("content")
            if not isinstance(content, str):
                raise ValueError(f"plain template: message {i} has no string content")
            if role == "system":
                parts.append(f"{content}\n")
            elif role == "user":
                parts.append(f"Question: {content}\n")
            elif role == "assistant":
                parts.append(content)
            elif role == "tool":
                parts.append(f"{INFORMATION[0]}{content}{INFORMATION[1]}")
            else:
                raise ValueError(f"plain template: message {i} has role {role!r}; "
                                 "expected system, user, assistant or tool")
        return "".join(parts)

    def prompt_ids(self, tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                   **kwargs) -> list[int]:
        """BOS id (when the tokenizer has one) + ``encode_rendered(tokenizer, render(messages))``:
        exactly ``AgentFormat.prompt_ids`` for ``[system SYSTEM_PROMPT, user question]``.

        Raises:
          ValueError: as ``render``.
        """
        bos = [] if tokenizer.bos_id is None else [int(tokenizer.bos_id)]
        return bos + encode_rendered(tokenizer, self.render(messages, add_generation_prompt))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Ids of a rendered template string; special-token strings inside it become their ids.

    ``apply_chat_template(tokenize=True)`` encodes the rendered string with
    ``add_special_tokens=False`` (no BOS/EOS from the post-processor); the tokenizers library
    matches added tokens (``<|im_start|>``, ``<|im_end|>``, …) in the text before BPE. The
    project's tokenizers already encode that way: ``HFTokenizer.encode`` calls
    ``Tokenizer.encode(text, add_special_tokens=False)``; ``SentencePieceTokenizer.encode`` adds no
    BOS/EOS and keeps the protocol tags as single pieces.

    Args:
      tokenizer: ``HFTokenizer`` or ``SentencePieceTokenizer`` (anything with ``encode(str)``).
      text: the rendered string.

    Returns:
      list of int ids, ``[seq]``.

    Raises:
      TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"encode_rendered needs a str, got {type(text).__name__}")
    return [int(i) for i in tokenizer.encode(text)]


# -- the MemPO system prompt ---------------------------------------------------------------------
def system_prompt(enabled_tools: Sequence[str], path: str | os.PathLike | None = None) -> str:
    """The MemPO system prompt, describing only the enabled tools (docs/algorithm.md §1).

    The text is ``prompts/mempo_system.txt`` (shipped in the package) or the file at ``path``;
    ``{action_tags}`` becomes e.g. ``"<search>, <access> or <answer>"`` and ``{actions}`` one line
    per enabled action from ``ACTION_DESCRIPTIONS`` (tools in ``TOOLS`` order, then ``<answer>``,
    which is always allowed). A file without the placeholders is used as it is. Trailing newlines
    of the file are dropped.

    Args:
      enabled_tools: a subset of ``("search", "access")``, any order; may be empty (answer only).
      path: a text file (UTF-8) to use instead of the packaged one (config ``system_prompt_path``):
        relative to the working directory, else a shipped file (``recipes.find_file``).

    Returns:
      The prompt text.

    Raises:
      ValueError: an unknown tool name (names it and the known ones), or an empty prompt file.
      FileNotFoundError: ``path`` does not exist (names it).
    """
    if isinstance(enabled_tools, str):
        enabled_tools = (enabled_tools,)
    unknown = [t for t in enabled_tools if t not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r} in enabled_tools; known tools: {list(TOOLS)}")
    actions = [t for t in TOOLS if t in enabled_tools] + ["answer"]
    if path is None:
        text = importlib.resources.files("mempo_jax.agent").joinpath(SYSTEM_PROMPT_FILE).read_text(encoding="utf-8")
        where = f"mempo_jax/agent/{SYSTEM_PROMPT_FILE}"
    else:
        found = find_file(path)  # the working directory, else a shipped file (configs/prompts/...)
        if found is None:
            raise FileNotFoundError(f"system prompt file not found: {path} (looked in the working directory "
                                    f"{os.getcwd()} and among the shipped configs)")
        text, where = found.read_text(encoding="utf-8"), str(found)
    text = text.rstrip("\n")
    if not text.strip():
        raise ValueError(f"system prompt file {where} is empty")
    tags = [f"<{a}>" for a in actions]
    action_tags = tags[0] if len(tags) == 1 else ", ".join(tags[:-1]) + " or " + tags[-1]
    return (text.replace("{action_tags}", action_tags)
            .replace("{actions}", "\n".join(ACTION_DESCRIPTIONS[a] for a in actions)))


def question_messages(question: str, system: str) -> list[dict[str, str]]:
    """``[{"role": "system", "content": system}, {"role": "user", "content": question}]``: the
    conversation a rollout starts from (the plain template renders it as ``AgentFormat.prompt_ids`` does)."""
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# -- tool-result layouts -------------------------------------------------------------------------
def _check_layout(layout: str) -> None:
    if layout not in TOOL_RESULT_LAYOUTS:
        raise ValueError(f"tool_result_layout must be one of {TOOL_RESULT_LAYOUTS}, got {layout!r}")


def observation_frame(template: "ChatTemplate | PlainTemplate", layout: str = "assistant",
                      context: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, str]:
    """``(before, after)``: the text appended after a sampled turn is ``before + body + after``,
    ``body`` being the tool result (the caller may cut its ids to ``max_observation_tokens``).

    * ``"assistant"`` — ``("<information>", "</information>")``: the result continues the
      assistant's stream (Search-R1 / ASearcher layout; the rollout's behaviour), for any template.
    * ``"user"`` / ``"tool"`` — the result is the content ``<information>body</information>`` of a
      user / tool message after the assistant's turn, then a new assistant turn is opened. Derived
      by rendering: with ``P = render(context, add_generation_prompt=True)`` and
      ``F = render(context + [assistant TURN, ROLE "<information>OBS</information>"],
      add_generation_prompt=True)``, ``F`` must start with ``P + TURN``; the rest, split at
      ``OBS``, is the frame. E.g. SmolLM2 (ChatML), role tool: ``("<|im_end|>\\n<|im_start|>tool\\n
      <information>", "</information><|im_end|>\\n<|im_start|>assistant\\n")``.

    The sampled turn is assumed to end at its closing action tag, without the end-of-turn token
    (the frame supplies it). A template whose generation prompt ends with a closed, empty reasoning
    block that its rendering of a completed assistant turn leaves out (Qwen3 with
    ``enable_thinking`` false) is accepted: the context stays append-only, the block kept. Sentinels without outer whitespace stand for the turn and the result,
    so a template that trims contents gives the same frame.

    Args:
      template: ``ChatTemplate`` or ``PlainTemplate``.
      layout: one of ``TOOL_RESULT_LAYOUTS``.
      context: the conversation before the turn (default: a system and a user message).

    Returns:
      ``(before, after)`` strings.

    Raises:
      ValueError: an unknown layout; a ``PlainTemplate`` with a layout other than "assistant" (it
        has no roles); a template that cannot render that role after an assistant message, that
        does not render an assistant message as its generation prompt followed by the content
        verbatim, or that does not keep the result's text verbatim (names the template's source).
    """
    _check_layout(layout)
    if layout == "assistant":
        return INFORMATION[0], INFORMATION[1]
    source = template.source
    if isinstance(template, PlainTemplate):
        raise ValueError(f"tool_result_layout {layout!r} needs a chat template; the plain template "
                         "only has the 'assistant' layout")
    ctx = list(context) if context is not None else question_messages("Q", "S")
    body = f"{INFORMATION[0]}{_OBS_SENTINEL}{INFORMATION[1]}"
    try:
        prompt = template.render(ctx, add_generation_prompt=True)
        full = template.render(ctx + [{"role": "assistant", "content": _TURN_SENTINEL},
                                      {"role": layout, "content": body}], add_generation_prompt=True)
    except ValueError as exc:
        raise ValueError(f"tool_result_layout {layout!r}: the chat template cannot put a {layout} message "
                         f"after an assistant turn ({exc})") from None
    head = prompt + _TURN_SENTINEL
    at = full.find(_TURN_SENTINEL)
    if at >= 0 and prompt.startswith(full[:at]) and _EMPTY_REASONING.fullmatch(prompt[at:]):
        # Qwen3 with its reasoning off: the generation prompt's closed empty <think></think>,
        # which the template drops from a completed turn, stays in the append-only context.
        head = full[:at] + _TURN_SENTINEL
    if not full.startswith(head):
        raise ValueError(f"tool_result_layout {layout!r}: chat template {source} does not render an assistant "
                         "message as its generation prompt followed by the message verbatim, so the text after a "
                         "sampled turn cannot be derived; use tool_result_layout='assistant'")
    rest = full[len(head):]
    if rest.count(body) != 1:
        raise ValueError(f"tool_result_layout {layout!r}: chat template {source} does not keep a {layout} "
                         "message's content verbatim; use tool_result_layout='assistant'")
    before, after = rest.split(_OBS_SENTINEL)
    return before, after


def observation_text(template, observation: str, layout: str = "assistant",
                     context: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The whole text appended after a sampled turn for the tool result ``observation``:
    ``before + observation + after`` of ``observation_frame(template, layout, context)``.

    Raises:
      TypeError: ``observation`` is not a str.
      ValueError: as ``observation_frame``.
    """
    if not isinstance(observation, str):
        raise TypeError(f"observation must be a str, got {type(observation).__name__}")
    before, after = observation_frame(template, layout, context)
    return before + observation + after


__all__ = [
    "ACTION_DESCRIPTIONS", "ChatTemplate", "PlainTemplate", "SYSTEM_PROMPT_FILE", "TOOLS", "TOOL_RESULT_LAYOUTS",
    "encode_rendered", "observation_frame", "observation_text", "question_messages", "system_prompt",
]
