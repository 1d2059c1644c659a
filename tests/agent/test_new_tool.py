"""A tool the package does not know, added without editing the rollout engine: an ``<echo>`` tool
registered in a ``ToolEnvironment`` beside search and access, its action given to the codec
(``TagCodec(..., actions=env.actions)``), run by the real ``RolloutEngine`` on a model that writes
``<mem> bob</mem> <echo> alice </echo>`` every turn (a bigram model: one-hot embeddings, attention and
MLP outputs zero, the LM head maps each token to the next one of that turn)."""

import inspect

import jax
import numpy as np

from toy_agent import QUESTIONS, WORDS, WordTokenizer

from mempo_jax.agent import engine as engine_module
from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.rollout import RolloutConfig, new_trajectories
from mempo_jax.agent.tags import TagCodec
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import abstract_model, split_model
from mempo_jax.text.protocol import INFORMATION, neutralize_tags, parse_turn
from mempo_jax.tools.bm25 import BM25Index
from mempo_jax.tools.corpus import Document
from mempo_jax.tools.environment import ToolEnvironment, ToolResult
from mempo_jax.tools.search import AccessTool, SearchTool

TURN = ("<mem>", "bob", "</mem>", "<echo>", "alice", "</echo>")


class EchoTool:
    """``<echo>text</echo>``: the text back, stripped, with protocol tags defused."""

    action = "echo"
    usage = "<echo>text</echo>"

    def __init__(self):
        self.calls: list[list[str]] = []

    def execute_batch(self, arguments):
        self.calls.append(list(arguments))
        return [ToolResult(neutralize_tags(a.strip(), ("echo", "answer")), "echo", True) for a in arguments]


def _bigram_model(tok):
    """A 1-layer decoder whose greedy next token after id i is ``TURN``'s next piece (``<mem>``
    after any other id)."""
    cfg = ModelConfig.tiny(tok.vocab_size, num_layers=1, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=8,
                           mlp_dim=32, tie_embeddings=False)
    graphdef, abstract = split_model(abstract_model(cfg))
    ids = [tok.piece_id(p) for p in TURN]
    head = np.zeros((cfg.embed_dim, tok.vocab_size), np.float32)
    head[:, ids[0]] = 1.0
    for a, b in zip(ids, ids[1:]):
        head[a], head[a, b] = 0.0, 10.0

    def init(path, x):
        name = jax.tree_util.keystr(path)
        if name.startswith("['embed']"):
            return np.eye(*x.shape, dtype=np.float32)
        if name.startswith("['lm_head']"):
            return head
        return np.ones(x.shape, np.float32) if "norm" in name else np.zeros(x.shape, np.float32)

    return cfg, graphdef, jax.tree.map(jax.numpy.asarray, jax.tree_util.tree_map_with_path(init, abstract))


def test_a_registered_tool_runs_in_the_rollout_without_an_engine_edit():
    tok = WordTokenizer(WORDS + ("<echo>", "</echo>"))
    backend = BM25Index([Document("0", "alice", "alice was born in paris")])
    echo = EchoTool()
    env = ToolEnvironment([SearchTool(backend, 1), AccessTool(backend), echo])
    assert env.actions == ("search", "access", "echo", "answer")
    fmt = AgentFormat(tok, TagCodec(tok, "tokens", actions=env.actions))
    assert tok.piece_id("</echo>") in fmt.codec.stop_ids
    model_cfg, graphdef, params = _bigram_model(tok)
    engine = RolloutEngine(graphdef, model_cfg, fmt.codec.stop_ids, tok.pad_id)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=8, max_context_tokens=128, max_observation_tokens=8,
                        temperature=0.0, min_rows_bucket=4, num_slots=3, decode_chunk=4, prefill_chunk=32)
    trajs = new_trajectories(fmt, QUESTIONS, 2)
    engine.rollout(params, trajs, fmt, env, cfg, jax.random.PRNGKey(0))
    echoed = [tok.piece_id(INFORMATION[0]), tok.piece_id("alice"), tok.piece_id(INFORMATION[1])]
    for tr in trajs:
        assert tr.end_reason == "max_turns" and len(tr.turns) == 3
        for turn in tr.turns:
            assert turn.output_ids == [tok.piece_id(p) for p in TURN]
            assert (turn.parsed.action, turn.parsed.argument, turn.parsed.error) == ("echo", " alice ", None)
            assert turn.tool_ok and turn.observation_ids == echoed
    assert sorted(a for call in echo.calls for a in call) == [" alice "] * 24
    source = inspect.getsource(engine_module)
    assert not any(name in source for name in ("echo", "<search>", "</access>", "ToolEnvironment"))


def test_an_action_without_a_tool_gets_an_error_observation():
    env = ToolEnvironment([EchoTool()])
    result = env.execute(parse_turn("<mem>m</mem><search>q</search>"))  # search: a default action, no tool here
    assert result == ToolResult(result.observation, "error", False)
    assert result.observation.startswith("Format error: unknown action <search>. Each turn must be:")
    assert "exactly one action: <echo>text</echo> or <answer>final answer</answer>." in result.observation
    malformed = env.execute(parse_turn("<mem>m</mem>stray<echo>a</echo>", env.actions))
    assert malformed.kind == "error" and "text outside blocks between tags: 'stray'" in malformed.observation
