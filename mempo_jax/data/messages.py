"""SFT trajectory files: chat ``messages`` rows ↔ ``Trajectory`` records (docs/algorithm.md §5).

A file is JSONL, a JSON array or parquet (``tools.records.iter_records``; parquet needs
``pyarrow``), one conversation per row in the layout of public agent-SFT sets::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "Who founded ...?"},
                  {"role": "assistant", "content": "<mem>…</mem><think>…</think><search>…</search>"},
                  {"role": "tool", "content": "[doc 17] Title: …"},
                  {"role": "assistant", "content": "<mem>…</mem><think>…</think><answer>…</answer>"}]}

Accepted grammar of ``messages`` (anything else is one ``ValueError`` naming file, line and field)::

    [system] user (assistant [tool])+

* ``system`` (optional, first only): replaces the format's system prompt (``AgentFormat.system_prompt``).
* ``user`` (exactly one): the question.
* every ``assistant`` is one policy turn; its content is the turn's text with the protocol tags
  written as text (``<mem>…</mem>``, ``<think>…</think>``, one action). Tags are not checked: a turn
  that ``parse_turn`` rejects is kept (and trained on) as written. At least one assistant message.
* a ``tool`` message is the raw tool result of the assistant turn just before it (not wrapped in
  ``<information>``: the format adds the wrapper and the ``max_observation_tokens`` cut). At most one
  tool message per assistant turn; a trailing tool message after the last turn is accepted (an episode
  cut at ``max_turns``). The last assistant turn may end in ``<answer>`` or not.

Every message needs ``role`` and ``content`` (a string; the list-of-parts content of some chat APIs
is refused); other keys of a message or a row (``name``, ``tool_call_id``, ``id``, ``golds``, …) are
ignored, except the optional row keys ``id`` (str: the question id) and ``golds`` (a list of alias
lists, one per objective) which are kept on the trajectory.

Conversion (``conversation_trajectory``) goes through the run's ``AgentFormat``: prompt ids =
``fmt.conversation_ids(system, user)`` (``fmt.prompt_ids(user)`` without a system message: the
rollout's own prompt), each assistant content → ``tokenizer.encode(content)`` (the tags as the
tokenizer writes them: single pieces in tokens mode, BPE text in text mode), its ``<mem>`` span
``fmt.mem_span(ids)``, each tool content → ``fmt.observation_ids(content, max_observation_tokens)``
(loss mask 0). These are the pieces the rollout concatenates, so a scripted conversation read back
equals the trajectory the rollout would record for the same ids. ``sft.sft_rows`` /
``trajectory.build_training_rows`` then cut the trajectories into rows (one per trajectory in
``full`` mode, one per turn in k-step mode; loss on assistant tokens only). Not kept from a file:
log-probs (``None``, SFT needs none) and ``tool_ok`` (True).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterable, Optional

from mempo_jax.text.protocol import parse_turn
from mempo_jax.agent.trajectory import FULL, Trajectory, Turn
from mempo_jax.tools.records import PathLike, field_error, iter_records

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One validated messages row.

    Attributes:
      system: the system message's content, or ``None`` when the row has none.
      user: the user message's content (the question).
      turns: one ``(assistant content, tool content or None)`` pair per assistant message.
      id: the row's ``id`` (or ``"{file}:{line}"`` when absent).
      golds: the row's ``golds`` (one alias tuple per objective; ``()`` when absent).
    """

    system: Optional[str]
    user: str
    turns: tuple[tuple[str, Optional[str]], ...]
    id: str = ""
    golds: tuple[tuple[str, ...], ...] = ()

    def to_row(self) -> dict[str, Any]:
        """The messages row of this conversation (``parse_row(c.to_row(), …) == c``)."""
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages.append({"role": "user", "content": self.user})
        for assistant, tool in self.turns:
            messages.append({"role": "assistant", "content": assistant})
            if tool is not None:
                messages.append({"role": "tool", "content": tool})
        row: dict[str, Any] = {"messages": messages}
        if self.id:
            row["id"] = self.id
        if self.golds:
            row["golds"] = [list(g) for g in self.golds]
        return row


def _golds(value, path, where) -> tuple[tuple[str, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and g and all(isinstance(a, str) for a in g) for g in value):
        raise field_error(path, where, "golds", "must be a list of alias lists of strings, one per objective")
    return tuple(tuple(g) for g in value)


def parse_row(row: Any, path: PathLike, where: int | str) -> Conversation:
    """Validate one messages row (grammar in the module docstring) into a ``Conversation``.

    Args:
      row: the decoded row (a dict with ``messages``).
      path, where: the file and its location of the row (``"17"`` for a JSONL line, ``"row 3"``
        for parquet), for the error message.

    Returns:
      the ``Conversation``.

    Raises:
      ValueError: ``"{path}:{where}: field 'messages[3].role': unknown role 'bot' …"`` — the first
        problem of the row: a missing or non-list ``messages``, a message that is not an object, a
        missing ``role`` / ``content``, an unknown role, non-string content, or a turn order outside
        ``[system] user (assistant [tool])+``.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{where}: row must be an object, got {type(row).__name__}")
    if "messages" not in row:
        raise field_error(path, where, "messages", "missing")
    messages = row["messages"]
    if not isinstance(messages, (list, tuple)):
        raise field_error(path, where, "messages", f"must be a list of messages, got {type(messages).__name__}")
    roles, contents = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise field_error(path, where, f"messages[{i}]", f"must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise field_error(path, where, f"messages[{i}].{key}", "missing")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise field_error(path, where, f"messages[{i}].role", f"unknown role {role!r} (expected one of "
                              f"{', '.join(ROLES)})")
        if not isinstance(content, str):
            raise field_error(path, where, f"messages[{i}].content",
                              f"must be a string, got {type(content).__name__}")
        roles.append(role), contents.append(content)

    grammar = "expected [system] user (assistant [tool])+"
    i, system = 0, None
    if roles[:1] == ["system"]:
        system, i = contents[0], 1
    if i >= len(roles) or roles[i] != "user":
        got = f"role {roles[i]!r}" if i < len(roles) else "end of messages"
        raise field_error(path, where, f"messages[{i}].role", f"{got} where the user message belongs; {grammar}")
    user, i = contents[i], i + 1
    if not user.strip():
        raise field_error(path, where, f"messages[{i - 1}].content", "empty user message")
    turns: list[list] = []
    for j in range(i, len(roles)):
        role = roles[j]
        if role == "assistant":
            if not contents[j].strip():
                raise field_error(path, where, f"messages[{j}].content", "empty assistant message")
            turns.append([contents[j], None])
        elif role == "tool":
            if not turns:
                raise field_error(path, where, f"messages[{j}].role", f"tool message before any assistant message; "
                                  f"{grammar}")
            if roles[j - 1] == "tool":
                raise field_error(path, where, f"messages[{j}].role", f"two tool messages in a row (one tool result "
                                  f"per assistant turn); {grammar}")
            turns[-1][1] = contents[j]
        else:
            raise field_error(path, where, f"messages[{j}].role", f"{role!r} message after the question; {grammar} "
                              "(tool results go in 'tool' messages)")
    if not turns:
        raise field_error(path, where, "messages", f"no assistant message (nothing to train on); {grammar}")
    qid = row.get("id", None)
    if qid is not None and not isinstance(qid, (str, int)):
        raise field_error(path, where, "id", f"must be a string, got {type(qid).__name__}")
    return Conversation(system, user, tuple((a, t) for a, t in turns),
                        str(qid) if qid is not None else f"{pathlib.Path(path).name}:{where}",
                        _golds(row.get("golds"), path, where))


def read_messages(path: PathLike) -> list[Conversation]:
    """Read and validate every row of a messages file (JSONL, JSON array or parquet).

    The whole file is validated before anything is returned, so a bad row stops a run before any
    training step.

    Args:
      path: the file (``SFTConfig.data_path``).

    Returns:
      one ``Conversation`` per row, in file order.

    Raises:
      FileNotFoundError: no such file (names it).
      ValueError: the first bad row (``parse_row``), invalid JSON (file and line), an empty file, or a
        parquet file without ``pyarrow`` installed (one line each).
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"SFTConfig.data_path: no such file: {path}")
    try:
        out = [parse_row(row, path, where) for where, row in iter_records(p)]
    except ImportError as e:  # parquet without pyarrow
        raise ValueError(str(e)) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise ValueError(f"{path}: no messages rows")
    return out


def write_messages(path: PathLike, rows: Iterable[dict[str, Any] | Conversation]) -> int:
    """Write messages rows to ``path``: JSONL (one compact row per line, UTF-8), or parquet when the
    name ends in ``.parquet`` (needs ``pyarrow``). Written to a temporary file and renamed, so a
    failure never leaves half a file.

    Returns:
      the number of rows written.

    Raises:
      ValueError: a row that ``parse_row`` rejects (named by its 1-based index), or parquet without pyarrow.
    """
    path = pathlib.Path(path)
    out = []
    for i, r in enumerate(rows, 1):
        row = r.to_row() if isinstance(r, Conversation) else r
        parse_row(row, f"{path} (row being written)", i)
        out.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: writing parquet needs pyarrow (pip install pyarrow)") from None
        pq.write_table(pa.Table.from_pylist(out), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in out:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return len(out)


def conversation_trajectory(conv: Conversation, fmt, max_observation_tokens: int, context_steps: int = FULL,
                            group_id: int = 0) -> Trajectory:
    """One conversation as a finished ``Trajectory`` of ids, built through the run's ``AgentFormat``.

    Args:
      conv: a validated conversation (``parse_row``).
      fmt: the run's ``AgentFormat`` (its tokenizer, tag codec, system prompt and template).
      max_observation_tokens: tool results are cut to this many tokens (``RolloutConfig``).
      context_steps: the context mode used for each turn's ``context_len`` (TT / PT statistics only;
        the training rows of any mode are cut later by ``build_training_rows``).
      group_id: group index recorded on the trajectory.

    Returns:
      ``Trajectory`` with ``prompt_ids = fmt.conversation_ids(system, user)``, or without a system
      message ``fmt.prompt_ids(user)`` (the format's system prompt: the rollout's prompt);
      per assistant message a ``Turn`` with ``output_ids = fmt.tokenizer.encode(content)``,
      ``parsed = parse_turn(content)``, ``mem_span = fmt.mem_span(output_ids)`` and
      ``observation_ids = fmt.observation_ids(tool content, max_observation_tokens)`` (``[]`` without
      a tool message). ``done`` is True; ``answer`` / ``end_reason`` follow the last turn (``"answer"``
      when it is a valid ``<answer>``, else ``"max_turns"``).
    """
    # No system message: the rollout's own prompt of this question (fmt.prompt_ids is
    # conversation_ids(fmt.system_prompt, question)), so SFT trains on the contexts RL samples from.
    prompt = fmt.prompt_ids(conv.user) if conv.system is None else fmt.conversation_ids(conv.system, conv.user)
    tr = Trajectory(conv.id, group_id, conv.golds, list(prompt))
    for assistant, tool in conv.turns:
        ids = [int(t) for t in fmt.tokenizer.encode(assistant)]
        ctx_len = len(tr.policy_context(context_steps))
        turn = Turn(ids, None, [], parse_turn(assistant), fmt.mem_span(ids), context_len=ctx_len)
        if tool is not None:
            turn.observation_ids = [int(t) for t in fmt.observation_ids(tool, max_observation_tokens)]
        tr.turns.append(turn)
    last = tr.turns[-1].parsed
    tr.done = True
    if last.error is None and last.action == "answer":
        tr.answer, tr.end_reason = (last.argument or "").strip(), "answer"
    else:
        tr.end_reason = "max_turns"
    return tr


def load_sft_trajectories(path: PathLike, fmt, max_observation_tokens: int,
                          context_steps: int = FULL) -> list[Trajectory]:
    """``read_messages`` + ``conversation_trajectory`` for every row (group id = row index).

    Raises:
      FileNotFoundError / ValueError: as ``read_messages``.
    """
    return [conversation_trajectory(c, fmt, max_observation_tokens, context_steps, g)
            for g, c in enumerate(read_messages(path))]


__all__ = ["ROLES", "Conversation", "conversation_trajectory", "load_sft_trajectories", "parse_row",
           "read_messages", "write_messages"]
