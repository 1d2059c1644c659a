"""Growing a model's vocabulary: new token-embedding (and untied LM-head) rows, as transformers does.

``resize_vocab`` is the JAX counterpart of transformers' ``PreTrainedModel.resize_token_embeddings(
new_num_tokens, pad_to_multiple_of, mean_resizing=True)`` (``modeling_utils.py``:
``_get_resized_embeddings``, ``_get_resized_lm_head``, ``_init_added_embeddings_weights_with_mean``),
used when protocol tags become added tokens of a checkpoint that has no spare embedding rows.

What is matched, precisely:

* the old rows are copied unchanged; the rows ``old … new - 1`` (the added tokens *and* the
  padding rows up to the multiple) are initialised;
* each initialised row is drawn from ``N(μ, 1e-9 · Σ)``, with ``μ`` the mean of the old rows and
  ``Σ = (E − μ)ᵀ(E − μ) / old_rows`` their biased covariance, when ``1e-9 · Σ`` is positive
  definite (a Cholesky factorisation succeeds, as ``torch.distributions.constraints.
  positive_definite``); otherwise every new row is exactly ``μ``;
* the embedding ``[V, D]`` and, when untied, the LM head (HF ``lm_head.weight [V, D]``, ours
  ``[D, V]``) are treated alike and independently; a tied head follows the embedding;
* ``pad_to_multiple_of`` rounds the new row count up as transformers does.

What differs: the statistics are computed in float32 as transformers does, but with numpy's
summation order (the mean accumulated in float64), and the noise comes from numpy's generator
with an explicit seed (transformers: torch's global RNG), so the new rows equal transformers' in
distribution, not bit for bit. The noise is tiny (standard deviation
``√1e-9 ≈ 3.2e-5`` of each dimension's spread): in effect the mean, which keeps the next-token
distribution of the old tokens almost unchanged (Hewitt 2021, "Initializing new word
embeddings for pretrained language models", the reference transformers cites).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Float

from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import abstract_model, split_model
from mempo_jax.model.hf_io import path_key
from mempo_jax.core.sharding import DEFAULT_RULES, Rules, mesh_or_local, param_shardings, rule_axes
from mempo_jax.model.hf_io import _host

DEFAULT_ROW_MULTIPLE = 64  # transformers' pad_to_multiple_of guidance (tensor cores); also TPU-friendly
MEAN_RESIZING_EPSILON = 1e-9  # transformers: covariance_matrix = epsilon * covariance


def padded_rows(rows: int, multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``multiple`` (transformers' ``pad_to_multiple_of``).

    Raises:
      ValueError: if ``multiple < 1`` or ``rows < 1``.
    """
    if int(multiple) < 1 or int(rows) < 1:
        raise ValueError(f"rows ({rows}) and multiple ({multiple}) must be >= 1")
    return -(-int(rows) // int(multiple)) * int(multiple)


def vocab_row_multiple(mesh=None, rules: Rules = DEFAULT_RULES, base: int = DEFAULT_ROW_MULTIPLE) -> int:
    """Row multiple that suits the mesh: ``lcm(base, product of the mesh axes the "vocab" rule
    shards over)`` (``tensor`` under ``DEFAULT_RULES``), so every shard holds equal rows (the
    default mesh, ``sharding.local_mesh()``, has one device: ``base``)."""
    mesh = mesh_or_local(mesh)
    shards = math.prod(int(mesh.shape[a]) for a in rule_axes(dict(rules).get("vocab")) if a in mesh.shape)
    return math.lcm(int(base), max(shards, 1))


def protocol_tag_rows(tokenizer, embedding_rows: int, mesh=None, rules: Rules = DEFAULT_RULES) -> int:
    """Embedding rows of a checkpoint whose protocol tags become single tokens
    (``ModelOptions.tags = "tokens"``): ``embedding_rows`` when its spare rows or reserved tokens
    suffice, else ``tokenizer.rows_for_protocol_tags`` rounded up to ``vocab_row_multiple(mesh,
    rules)`` (the rows ``resize_vocab`` grows the embedding to). ``tokenizer`` is an
    ``HFTokenizer``; ``mesh`` may be abstract (only its axis sizes are read)."""
    rows = tokenizer.rows_for_protocol_tags(embedding_rows)
    return rows if rows <= embedding_rows else padded_rows(rows, vocab_row_multiple(mesh, rules))


def mean_resized_rows(old: Float[ArrayLike, "vocab embed"], new_rows: int,
                      seed: int = 0) -> Float[np.ndarray, "{new_rows} embed"]:
    """``[new_rows, D]``: the ``[V, D]`` rows of ``old`` followed by ``new_rows - V`` rows drawn from
    ``N(μ, 1e-9 Σ)`` (or exactly ``μ`` when that covariance is not positive definite).

    Source: transformers ``_init_added_embeddings_weights_with_mean`` (see the module docstring).

    Raises:
      ValueError: if ``new_rows`` is smaller than ``V`` (shrinking is not supported).
    """
    old = np.asarray(old)
    v, d = old.shape
    if new_rows < v:
        raise ValueError(f"cannot shrink the vocabulary from {v} to {new_rows} rows")
    out = np.empty((new_rows, d), old.dtype)
    out[:v] = old
    added = new_rows - v
    if added == 0:
        return out
    x = old.astype(np.float32)  # transformers: old_embeddings.weight.to(torch.float32)
    mean = x.mean(axis=0, dtype=np.float64).astype(np.float32)
    centered = x - mean
    cov = (MEAN_RESIZING_EPSILON * (centered.T @ centered / np.float32(v))).astype(np.float32)
    try:
        chol = np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        chol = None
    if chol is None:
        out[v:] = mean.astype(old.dtype)
    else:
        z = np.random.default_rng(seed).standard_normal((added, d))
        out[v:] = (mean + z @ chol.astype(np.float64).T).astype(old.dtype)
    return out


def resize_vocab(
    cfg: ModelConfig,
    params: nnx.State,
    new_rows: int,
    *,
    mesh=None,
    rules: Rules = DEFAULT_RULES,
    seed: int = 0,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """The model with ``new_rows`` token-embedding rows (and LM-head columns when untied).

    Args:
      cfg: the model's config (``vocab_size`` = its current rows).
      params: its ``nnx.State`` (any sharding; the embedding and head are gathered to the host).
      new_rows: the new ``vocab_size`` (≥ ``cfg.vocab_size``; round it with ``padded_rows``).
      mesh, rules: place the resized tensors in their sharding on ``mesh`` (default ``sharding.local_mesh()``: one device).
      seed: seed of the ``N(μ, 1e-9 Σ)`` draws (the LM head uses ``seed + 1``).

    Returns:
      ``(cfg, graphdef, params)`` with ``cfg.vocab_size == new_rows``; every other parameter is
      the same array as before.

    Raises:
      ValueError: if ``new_rows < cfg.vocab_size``.
    """

    new_rows = int(new_rows)
    if new_rows < cfg.vocab_size:
        raise ValueError(f"cannot shrink the vocabulary from {cfg.vocab_size} to {new_rows} rows")
    new_cfg = cfg.replace(vocab_size=new_rows)
    graphdef, abstract = split_model(abstract_model(new_cfg))
    if new_rows == cfg.vocab_size:
        return new_cfg, graphdef, params
    resized = {("embed",): mean_resized_rows(_host(params["embed"].get_value()), new_rows, seed)}
    if not cfg.tie_embeddings:  # ours [D, V] = HF lm_head.weight [V, D] transposed
        head = _host(params["lm_head"].get_value())
        resized[("lm_head",)] = mean_resized_rows(head.T, new_rows, seed + 1).T
    shardings = param_shardings(abstract, mesh_or_local(mesh), rules)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    old_flat = {path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]}

    def fill(path, var):
        k = path_key(path)
        if k not in resized:
            return var.replace(old_flat[k].get_value())
        arr = np.ascontiguousarray(resized[k])
        sharding = shardings
        for part in k:
            sharding = sharding[part]
        return var.replace(jax.make_array_from_callback(arr.shape, sharding.get_value(), lambda idx: arr[idx]))

    return new_cfg, graphdef, jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=is_var)
