"""Import and export Hugging Face checkpoints (Qwen2 / Llama / Qwen3 / Gemma 3 text layouts:
config.json + safetensors).

Source of the layout: ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` /
``Gemma3ForCausalLM`` ``state_dict`` names in transformers (Qwen3 and Gemma 3 add
``self_attn.q_norm`` / ``k_norm``; Gemma 3's ``post_attention_layernorm`` is the attention
output's norm and ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` frame its MLP), and the safetensors sharding index (``model.safetensors.index.json``:
``{"metadata": {"total_size"}, "weight_map": {name: file}}``).

Import reads one parameter at a time with ``safetensors.safe_open`` (a decoder-layer parameter
from its ``num_layers`` tensors, stacked on a leading axis as ``Decoder`` stores them), reshapes
it to our layout and places it straight into its target sharding
(``jax.make_array_from_callback``: every device only receives its own slice). Every checkpoint key is consumed exactly once; an unknown, missing or
mis-shaped key raises ``CheckpointError`` naming the key.

Layout map (HF torch ``Linear.weight`` is ``[out, in]``; ours is ``[in, ...out]``):
``q_proj.weight [H*hd, D] → q [D, H, hd]``, ``o_proj.weight [D, H*hd] → o [H, hd, D]``,
``gate/up_proj [F, D] → [D, F]``, ``down_proj [D, F] → [F, D]``, ``lm_head [V, D] → [D, V]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mempo_jax.text.hf_tokenizer import COPIED_FILES
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.hf_config import CheckpointError, config_from_hf, config_to_hf
from mempo_jax.model.forward import abstract_model, split_model
from mempo_jax.core.sharding import DEFAULT_RULES, Rules, mesh_or_local, param_shardings

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# What ``HFTokenizer.save`` writes or copies into an exported folder (those the source has).
TOKENIZER_FILES = ("tokenizer.json",) + COPIED_FILES
# Non-parameter buffers some older checkpoints carry; recomputed from the config, never loaded.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


# ------------------------------------------------------------------------------------ name map

# Layout kinds: how an HF tensor maps onto our parameter of shape ``target``:
# copy, transpose, proj_in (q/k/v weight), proj_bias (q/k/v bias), proj_out (o weight).


def _hf_shape(kind: str, target: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "copy":
        return target
    if kind == "transpose":
        return target[::-1]
    if kind == "proj_in":  # ours [D, N, hd]  ← HF [N*hd, D]
        return (target[1] * target[2], target[0])
    if kind == "proj_bias":  # ours [N, hd] ← HF [N*hd]
        return (target[0] * target[1],)
    if kind == "proj_out":  # ours [H, hd, D] ← HF [D, H*hd]
        return (target[2], target[0] * target[1])
    raise AssertionError(kind)


def _to_ours(kind: str, arr: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
    if kind == "copy" or kind == "proj_bias":
        return arr.reshape(target)
    if kind == "transpose":
        return arr.T
    if kind == "proj_in":
        return arr.T.reshape(target)
    if kind == "proj_out":
        return arr.T.reshape(target)
    raise AssertionError(kind)


def _to_hf(kind: str, arr: np.ndarray) -> np.ndarray:
    if kind == "copy":
        return arr
    if kind == "transpose":
        return arr.T
    if kind == "proj_in":
        return arr.reshape(arr.shape[0], -1).T
    if kind == "proj_bias":
        return arr.reshape(-1)
    if kind == "proj_out":
        return arr.reshape(-1, arr.shape[-1]).T
    raise AssertionError(kind)


class HFName(NamedTuple):
    """Where one HF tensor goes: our parameter ``path`` in the ``nnx.State``, the ``layer`` index
    on its leading axis for a decoder layer's tensor (``None`` otherwise; ``Decoder`` stores the
    layers stacked), and the layout ``kind``."""

    path: tuple
    layer: int | None
    kind: str


def hf_name_map(cfg: ModelConfig) -> dict[str, HFName]:
    """HF tensor name → ``HFName`` (our parameter, its layer, the layout kind), in checkpoint order.

    The tied LM head has no entry (transformers omits ``lm_head.weight`` when tied).
    """
    names: dict[str, HFName] = {"model.embed_tokens.weight": HFName(("embed",), None, "copy")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def put(key, *path, kind, i=i):
            names[p + key] = HFName(("layers",) + path, i, kind)

        put("input_layernorm.weight", "attn_norm", "weight", kind="copy")
        for x in ("q", "k", "v"):
            put(f"self_attn.{x}_proj.weight", "attn", x, kind="proj_in")
            if cfg.qkv_bias:
                put(f"self_attn.{x}_proj.bias", "attn", f"{x}_bias", kind="proj_bias")
        if cfg.qk_norm:
            put("self_attn.q_norm.weight", "attn", "q_norm", "weight", kind="copy")
            put("self_attn.k_norm.weight", "attn", "k_norm", "weight", kind="copy")
        put("self_attn.o_proj.weight", "attn", "o", kind="proj_out")
        if cfg.post_norms:  # Gemma: post_attention_layernorm is the attention output's norm
            put("post_attention_layernorm.weight", "attn_post_norm", "weight", kind="copy")
            put("pre_feedforward_layernorm.weight", "mlp_norm", "weight", kind="copy")
            put("post_feedforward_layernorm.weight", "mlp_post_norm", "weight", kind="copy")
        else:  # Qwen / Llama: post_attention_layernorm is the MLP's input norm
            put("post_attention_layernorm.weight", "mlp_norm", "weight", kind="copy")
        for x in ("gate", "up", "down"):
            put(f"mlp.{x}_proj.weight", "mlp", x, kind="transpose")
    names["model.norm.weight"] = HFName(("final_norm", "weight"), None, "copy")
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = HFName(("lm_head",), None, "transpose")
    return names


def path_key(path) -> tuple:
    """A ``jax.tree_util.tree_flatten_with_path`` path as plain keys: a dict entry's key, an
    attribute's name, any other entry as is (e.g. ``("layers", "attn", "q", "kernel")``)."""
    return tuple(k.key if isinstance(k, jax.tree_util.DictKey) else k.name if isinstance(k, jax.tree_util.GetAttrKey)
                 else k for k in path)


# ------------------------------------------------------------------------------------- import


def _checkpoint_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Key → safetensors file, from the index when present, else every ``*.safetensors``."""
    index = path / INDEX_FILE
    key_file: dict[str, pathlib.Path] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {path / f for f in weight_map.values()}
    else:
        files = set(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    for f in sorted(files):
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f.name} listed in {INDEX_FILE} is missing")
        with safe_open(str(f), framework="np") as st:
            for key in st.keys():
                if key in key_file:
                    raise CheckpointError(f"checkpoint key {key} appears in both {key_file[key].name} and {f.name}")
                key_file[key] = f
    if index.is_file():
        for key, fname in weight_map.items():
            if key not in key_file or key_file[key].name != fname:
                raise CheckpointError(f"checkpoint key {key} is listed in {INDEX_FILE} under {fname} but not stored there")
    return key_file


def read_hf_config(path: str | os.PathLike, **dtypes) -> ModelConfig:
    """``config_from_hf`` of ``path/config.json`` (``dtype=``, ``param_dtype=`` passed on)."""
    return config_from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()), **dtypes)


def load_hf_checkpoint(
    path: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Load a Qwen2 / Llama / Qwen3 / Gemma 3 (text) checkpoint directory into ``(cfg, graphdef, params)``.

    Args:
      path: folder with ``config.json`` and ``*.safetensors`` (+ optional index).
      mesh: target mesh; params are placed by ``param_shardings(…, mesh, rules)`` (default
        ``sharding.local_mesh()``, one device).
      rules: logical-axis rules.
      dtype, param_dtype: activation / parameter dtype names of the returned config; tensors
        are cast to ``param_dtype`` on the host before placement.

    Returns:
      ``(cfg, graphdef, params)`` as ``mempo_jax.model.forward.split_model``.

    Raises:
      CheckpointError: naming the key for an unknown, missing, duplicated or mis-shaped tensor,
        or a tied checkpoint whose ``lm_head.weight`` differs from the embedding; or naming the
        field of an unsupported config.
      FileNotFoundError: if ``config.json`` is absent.
    """
    path = pathlib.Path(path)
    cfg = read_hf_config(path, dtype=dtype, param_dtype=param_dtype)
    names = hf_name_map(cfg)
    key_file = _checkpoint_files(path)
    tied_head = cfg.tie_embeddings and "lm_head.weight" in key_file
    _check_keys(names, key_file, tied_head)
    graphdef, abstract = split_model(abstract_model(cfg))
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    targets = {path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_var)[0]}
    flat = jax.tree_util.tree_flatten_with_path(param_shardings(abstract, mesh_or_local(mesh), rules), is_leaf=is_var)[0]
    shardings = {path_key(p): v.get_value() for p, v in flat}
    loaded = _read_tensors(names, key_file, targets, shardings, jnp.dtype(param_dtype))
    if tied_head:
        _check_tied_head(key_file)

    def fill(p, var):
        return var.replace(loaded[path_key(p)])

    params = jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=is_var)
    return cfg, graphdef, params


def _check_keys(names: dict, key_file: dict, tied_head: bool) -> None:
    """Every checkpoint key known and every parameter's key present.

    Raises:
      CheckpointError: naming the unknown or missing keys.
    """
    unknown = sorted(k for k in key_file if k not in names and not _IGNORED.match(k)
                     and not (tied_head and k == "lm_head.weight"))
    if unknown:
        raise CheckpointError(f"unknown checkpoint key(s) for this config: {', '.join(unknown)}")
    missing = [k for k in names if k not in key_file]
    if missing:
        raise CheckpointError(f"missing checkpoint key(s): {', '.join(missing)}")


def _read_tensors(names: dict, key_file: dict, targets: dict, shardings: dict, np_dtype) -> dict[tuple, jax.Array]:
    """Our parameter path → its array, cast to ``np_dtype`` on the host and placed straight into
    its sharding (``jax.make_array_from_callback``). One parameter is on the host at a time: a
    stacked layer parameter is assembled from its ``num_layers`` tensors.

    Raises:
      CheckpointError: naming a key whose shape is not the config's.
    """
    by_param: dict[tuple, list[tuple[str, HFName]]] = {}
    for key, name in names.items():
        by_param.setdefault(name.path, []).append((key, name))
    loaded: dict[tuple, jax.Array] = {}
    with contextlib.ExitStack() as files:
        opened: dict[pathlib.Path, Any] = {}

        def tensor(key: str, kind: str, target: tuple[int, ...]) -> np.ndarray:
            f = key_file[key]
            if f not in opened:
                opened[f] = files.enter_context(safe_open(str(f), framework="np"))
            want, got = _hf_shape(kind, target), tuple(opened[f].get_slice(key).get_shape())
            if got != want:
                raise CheckpointError(f"checkpoint key {key} has shape {got}, expected {want}")
            return _to_ours(kind, opened[f].get_tensor(key), target).astype(np_dtype)

        for ours, keys in by_param.items():
            target = tuple(targets[ours].get_value().shape)
            if keys[0][1].layer is None:
                arr = np.ascontiguousarray(tensor(keys[0][0], keys[0][1].kind, target))
            else:
                arr = np.empty(target, np_dtype)
                for key, name in keys:
                    arr[name.layer] = tensor(key, name.kind, target[1:])
            loaded[ours] = jax.make_array_from_callback(target, shardings[ours], lambda idx, a=arr: a[idx])
            del arr
    return loaded


def _check_tied_head(key_file: dict) -> None:
    """A tied checkpoint's stored ``lm_head.weight`` equals its embedding.

    Raises:
      CheckpointError: when it differs.
    """
    with safe_open(str(key_file["lm_head.weight"]), framework="np") as st:
        head = st.get_tensor("lm_head.weight")
    with safe_open(str(key_file["model.embed_tokens.weight"]), framework="np") as st:
        same = head.shape == tuple(st.get_slice("model.embed_tokens.weight").get_shape()) and np.array_equal(
            head, st.get_tensor("model.embed_tokens.weight"))
    if not same:
        raise CheckpointError("checkpoint key lm_head.weight differs from model.embed_tokens.weight "
                              "but config.json has tie_word_embeddings=true")


# ------------------------------------------------------------------------------------- export


def _host(x: jax.Array | np.ndarray) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig,
    params: nnx.State,
    *,
    model_type: str | None = None,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    tokenizer=None,
) -> list[str]:
    """Write ``config.json`` and safetensors in the HF layout, loadable by ``from_pretrained``.

    Tensors are written in ``cfg.param_dtype`` (as stored in ``params``). Above
    ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` files
    plus ``model.safetensors.index.json``; otherwise one ``model.safetensors``. Only process 0
    writes (every process must call it: sharded arrays are gathered collectively).

    Args:
      path: output folder (created).
      cfg: the model's config.
      params: ``nnx.State`` from ``split_model`` / ``load_hf_checkpoint``.
      model_type, extra_config: see ``config_to_hf``.
      max_shard_bytes: shard size threshold in bytes.
      tokenizer: optional ``HFTokenizer`` (e.g. with protocol tags added as tokens, the embedding
        resized by ``model.resize.resize_vocab``): its ``tokenizer.json`` and the source's
        tokenizer / generation / chat-template files are written beside the weights
        (``HFTokenizer.save``), and ``config.json`` gets its ``bos_token_id`` / ``eos_token_id`` /
        ``pad_token_id`` unless ``extra_config`` sets them, so that transformers'
        ``from_pretrained`` + ``generate`` uses the same ids.

    Returns:
      The file names written (config first, then weights, then the tokenizer's files).

    Raises:
      CheckpointError: if the config cannot be expressed (``config_to_hf``) or a parameter is
        missing from ``params``.
    """
    path = pathlib.Path(path)
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
        extra_config = {**ids, **(extra_config or {})}
    hf_config = config_to_hf(cfg, model_type, extra_config)
    flat = {path_key(p): v.get_value() for p, v in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
    names = hf_name_map(cfg)
    plan, sizes = _shard_plan(names, flat, max_shard_bytes)  # from shapes alone: one shard fetched at a time
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    n = len(plan)
    fnames = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for fname, keys in zip(fnames, plan):
        shard = {}
        for key in keys:
            ours, layer, kind = names[key]
            value = flat[ours] if layer is None else flat[ours][layer]
            shard[key] = np.ascontiguousarray(_to_hf(kind, _host(value)))
        if writer:
            save_file(shard, str(path / fname), metadata={"format": "pt"})
        del shard
    if not writer:
        return []
    written = ["config.json"] + fnames
    if n > 1:
        index = {"metadata": {"total_size": int(sum(sizes))},
                 "weight_map": {k: f for f, keys in zip(fnames, plan) for k in keys}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    if tokenizer is not None:
        tokenizer.save(path)
        written += [name for name in TOKENIZER_FILES if (path / name).is_file()]
    return written


def _shard_plan(names: dict, flat: dict, max_shard_bytes: int) -> tuple[list[list[str]], list[int]]:
    """The checkpoint keys of each safetensors file (in ``names`` order, a new file once
    ``max_shard_bytes`` would be passed) and each file's bytes, from the arrays' shapes alone.

    Raises:
      CheckpointError: a parameter that a key needs is missing from ``flat``.
    """
    plan: list[list[str]] = [[]]
    sizes = [0]
    for key, (ours, layer, _) in names.items():
        if ours not in flat:
            raise CheckpointError(f"params lack {'/'.join(map(str, ours))} needed for checkpoint key {key}")
        shape = flat[ours].shape if layer is None else flat[ours].shape[1:]
        nbytes = int(np.prod(shape)) * jnp.dtype(flat[ours].dtype).itemsize
        if plan[-1] and sizes[-1] + nbytes > max_shard_bytes:
            plan.append([])
            sizes.append(0)
        plan[-1].append(key)
        sizes[-1] += nbytes
    return plan, sizes


__all__ = [
    "CheckpointError", "HFName", "config_from_hf", "config_to_hf", "hf_name_map", "load_hf_checkpoint",
    "read_hf_config", "save_hf_checkpoint",
]
