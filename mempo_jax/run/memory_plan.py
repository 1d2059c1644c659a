"""Memory plan of a recipe on its TPU slice (the ``python -m mempo_jax.commands.plan`` command prints it).

Builds the policy (``nnx.eval_shape`` of the decoder), the AdamW state and the sampler's KV cache
(``jax.eval_shape`` of the jitted initialisers with their ``out_shardings``) on the *target* mesh —
a device-less ``AbstractMesh`` of the slice's device count (``TPUConfig.accelerator_type``) and the
config's ``MeshConfig`` and rules — and reads bytes per device off the shard shapes. Activations are estimated for
the present model code (decoder layers rematerialised or not, ``ExecutionConfig.remat``; dense
attention materialises ``[rows, heads, L, S]`` float32 scores and probabilities; the LM head runs
``ExecutionConfig.logit_chunk_tokens`` positions at a time, float32 ``[rows, chunk, vocab]``), sharded by the same
logical-axis rules (rows over data × fsdp, heads / mlp / vocab over tensor), for each phase of a
step:

Every pass scans the decoder layers as they are stored (stacked, ``[num_layers, ...]``): no
program holds a copy of them; an fsdp mesh gathers one layer's weights at a time.

* sampling: KV cache + prefill (``[rows, P, vocab]`` logits, one layer's transients);
* log-probs (``TrainSteps.logprobs`` chunks; the reference and the trainer's old log-probs run
  packed, ``rl.step.detached_logprobs``, on no more rows per call at the same length bucket,
  which this bound covers; a packed call may pick 2× or 4× that length when it computes fewer
  positions, capped at the longest precompiled length only after ``RLConfig.precompile``: not
  covered): the LM-head matrix as its matmul reads it, one chunk's logits and their log-softmax
  terms, and the larger stage of one layer (its MLP or its attention);
* memory-reward scoring, packed (``MemoryRewardScorer.packed_logprobs``: ``[R, L]`` calls of the
  stacked ``[full; mem]`` rows packed end to end, segment-masked attention ``[R, heads, L, L]``,
  the LM head only at the ``L // ANSWER_FRACTION`` answer positions of each packed row), counted
  as the log-probs;
* update (one PPO micro-batch; its rows packed end to end at the same length): activations
  saved for the backward pass of every layer (each layer's input only under remat) and the
  recomputed layer's, one chunk's float32 logits and their gradient, the embedding / LM-head
  copies and gradients, plus the gradient accumulator and one micro-batch's gradient.

Each phase's terms are in ``MemoryPlan.terms`` (and the printed table), so the one to lower is named.

Peak per device = parameters + optimizer state + reference + the largest phase. With LoRA
(``LoraConfig.rank > 0``) the optimizer state, the gradients and the reference copy are those of
the adapters alone (the frozen base, in ``LoraConfig.base_dtype``, is shared by the reference). The plan
does not fit (``MemoryPlan.fits`` false; ``fit_error`` names the largest term) when the peak exceeds
``PlanConfig.hbm_fraction`` of the chip's HBM (v5e 16 GiB, v5p 95 GiB, v6e 32 GiB).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from mempo_jax.agent.engine import extend_shapes, num_slots
from mempo_jax.agent.slot_sampler import SlotSampler, slot_cache_size
from mempo_jax.agent.trajectory import FULL
from mempo_jax.core.batching import bucket_length
from mempo_jax.core.rollout_mesh import rollout_mesh
from mempo_jax.core.sharding import (DEFAULT_RULES, logical_to_spec, make_mesh, opt_state_shardings, param_shardings,
                                     rule_axes)
from mempo_jax.model.attention_xla import BLOCK_K, BLOCK_Q, use_blocked
from mempo_jax.model.config import ModelConfig, PRESET_SHAPES
from mempo_jax.model.decoder import init_cache
from mempo_jax.model.forward import abstract_model, make_logits_fn, split_model
from mempo_jax.model.hf_io import read_hf_config
from mempo_jax.model.lora import split_trainable
from mempo_jax.model.placement import cache_shardings
from mempo_jax.model.resize import protocol_tag_rows
from mempo_jax.rl.learner import TrainSteps, make_optimizer
from mempo_jax.rl.losses import LossConfig
from mempo_jax.rl.memory_reward import ANSWER_FRACTION, DEFAULT_CHUNK_ROWS, MemoryRewardScorer
from mempo_jax.text.hf_tokenizer import HFTokenizer

GIB = 2**30
# Calibration of the activation estimate against XLA's own ``compiled.memory_analysis()`` of each
# phase's program (tests/test_plan.py: SmolLM2- and Qwen2.5-0.5B-shaped models on an emulated
# 8-device fsdp mesh, plan within [1, 1.3] x XLA). Bytes per attention-score element live in one
# layer's forward (one float32 buffer: XLA fuses the mask, exponentials and normalisation) and kept for
# its backward (probabilities and the scores' gradient); float32 logits blocks live per phase (the
# sampler's prefill logits, log-softmax and scaled copy; in the log-prob and scoring passes one
# LM-head chunk, and a second that XLA's packing of the layer and LM-head scans reserves beside it;
# the update's chunk and its gradient); and the embedding / LM-head matrices the update holds whole per device (the
# gathered table, the head's and the lookup's gradients and their sum) when fsdp shards them.
ATTENTION_BYTES = 4
SAMPLER_ATTENTION_BYTES = 16  # the sampler's prefill over the cache: scores, masked, exponentials, probabilities
SAVED_ATTENTION_BYTES = 8
# the blocked attention's backward pass, per element of one query block's scores over every key:
# the rematerialised block's scores, probabilities and their gradient (float32)
SAVED_BLOCKED_ATTENTION_BYTES = 12
LOGIT_COPIES = {"sampling": 3, "logprobs": 2, "scoring": 2, "update": 2}
EMBEDDING_COPIES = 4


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one recipe on one slice (all sizes in bytes unless named otherwise).

    Attributes:
      model: ``model_source`` (checkpoint folder or preset name); ``num_params``: parameter count.
      accelerator, chip, num_devices, hbm_bytes: the slice (HBM per device).
      mesh: ``{"data", "fsdp", "tensor"}`` sizes.
      params, opt_state, reference, kv_cache: resident / cache bytes per device.
      phases: ``{"sampling", "logprobs", "scoring", "update"}`` transient bytes per device
        (``sampling`` includes the KV cache, ``update`` the gradients): the sum of ``terms[phase]``.
      terms: ``{phase: {term: bytes}}``, what each phase holds: ``kv_cache``, ``logits`` (the float32
        LM-head blocks), ``layer`` (one decoder layer's live activations), ``rollout_weights`` (the
        sampler's cast copy), ``weights`` (gathered weights), ``gradients``, ``embedding`` (the
        embedding / LM-head copies of the update) and ``saved`` (activations kept for the backward).
      shapes: the row / length sizes the estimate used.
      peak: parameters + optimizer state + reference + max(phases).
      budget: ``hbm_fraction * hbm_bytes``.
    """

    model: str
    num_params: int
    accelerator: str
    chip: str
    num_devices: int
    hbm_bytes: int
    mesh: dict
    params: int
    opt_state: int
    reference: int
    kv_cache: int
    phases: dict
    terms: dict
    shapes: dict
    peak: int
    budget: int

    @property
    def fits(self) -> bool:
        """True when the peak fits the HBM budget."""
        return self.peak <= self.budget

    @property
    def activations(self) -> int:
        """The largest phase's bytes without the KV cache and gradients (the 'activations' line)."""
        return max(self.phases["sampling"] - self.kv_cache, self.phases["logprobs"], self.phases["scoring"],
                   self.phases["update"] - self.shapes["gradient_bytes"])

    @property
    def peak_phase(self) -> str:
        """Name of the largest phase."""
        return max(self.phases, key=self.phases.get)


def model_source(cfg) -> str:
    """Where the plan's architecture comes from: ``ModelOptions.checkpoint`` when its
    ``config.json`` is on disk; else ``ModelOptions.preset`` when it names a pretrained
    architecture (a pod recipe is planned before its weights are downloaded: its preset is the
    same architecture); else (preset ``tiny``, a from-scratch model) nothing.

    Raises:
      ValueError: (one line) a checkpoint whose ``config.json`` cannot be read and no pretrained
        preset to stand for it.
    """
    if cfg.model.checkpoint and pathlib.Path(cfg.model.checkpoint, "config.json").is_file():
        return cfg.model.checkpoint
    if cfg.model.checkpoint and cfg.model.preset == "tiny":
        raise ValueError(f"cannot read {pathlib.Path(cfg.model.checkpoint, 'config.json')} "
                         f"(ModelOptions.checkpoint, relative to {pathlib.Path.cwd()}): convert or download the "
                         f"checkpoint first, or bind ModelOptions.preset to its architecture")
    return cfg.model.preset


def model_config(cfg, mesh=None, rules=None):
    """The ``ModelConfig`` of an ``ExperimentConfig`` (as ``build_experiment``), from
    ``model_source``: the checkpoint's ``config.json`` (its dtype overrides applied, and with
    ``tags = "tokens"`` the rows the tags add on ``mesh``: ``resize.protocol_tag_rows``, as
    ``load_checkpoint_policy``), or the preset (``tiny`` uses the configured ``vocab_size``) with
    its overrides.

    Raises:
      ValueError: an unknown preset.
    """

    if cfg.model.checkpoint and model_source(cfg) == cfg.model.checkpoint:
        model_cfg = read_hf_config(cfg.model.checkpoint, **dict(cfg.model.overrides))
        if cfg.model.tags == "text":
            return model_cfg
        rows = protocol_tag_rows(HFTokenizer(cfg.model.checkpoint), model_cfg.vocab_size, mesh, rules or DEFAULT_RULES)
        return model_cfg.replace(vocab_size=rows)
    preset = cfg.model.preset
    if preset != "tiny" and preset not in PRESET_SHAPES:
        raise ValueError(f"ModelOptions.preset {preset!r} is not a ModelConfig preset")
    model_cfg = ModelConfig.tiny(cfg.vocab_size) if preset == "tiny" else ModelConfig.preset(preset)
    return model_cfg.replace(**dict(cfg.model.overrides)) if cfg.model.overrides else model_cfg


def _sharded_bytes(tree) -> int:
    """Sum over ``ShapeDtypeStruct`` leaves (with shardings) of the bytes of one device's shard."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _gathered_bytes(abstract, shardings, mesh, rules) -> int:
    """Bytes per device of the parameters that the ``fsdp`` (or ``data``) axis shards at rest,
    gathered over it (still split over ``tensor``): what a matmul of each needs whole."""
    import jax

    def kept(target):
        return tuple(a for a in rule_axes(target) if a not in ("fsdp", "data")) or None

    gathered = param_shardings(abstract, mesh, tuple((name, kept(target)) for name, target in rules))
    total = 0
    for leaf, at_rest, whole in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), jax.tree.leaves(gathered)):
        n = math.prod(whole.shard_shape(leaf.shape))
        if n > math.prod(at_rest.shard_shape(leaf.shape)):
            total += n * leaf.dtype.itemsize
    return total


def step_shapes(cfg, plan_cfg) -> dict:
    """Row and length sizes of one step, as the rollout, ``build_training_rows`` and the scorer
    bucket them (powers of two), worst case over the step.

    The sampling rows are the slots (``engine.num_slots``), the cache
    ``slot_cache_size(max_context_tokens)`` long, and a prefill call at most one
    ``prefill_chunk``-token row per slot (P = ``prefill_chunk``).

    Returns a dict with ``rollout_rows``, ``prompt_len`` (P), ``cache_len`` (S = P + N),
    ``train_len``, ``scoring_rows``, ``scoring_len``.
    """

    ro = cfg.rl.rollout
    traj = cfg.rl.questions_per_step * cfg.rl.group_size
    turn = ro.max_new_tokens + ro.max_observation_tokens + 2  # output + <information> … </information>
    full_len = plan_cfg.max_prompt_tokens + ro.max_turns * turn
    train_len = bucket_length(full_len if ro.context_steps == FULL else ro.max_context_tokens)
    scoring_len = bucket_length(plan_cfg.max_prompt_tokens + (ro.max_turns - 1) * turn + 1 + plan_cfg.max_answer_tokens)
    mem_turns = traj * ro.max_turns
    all_rows = bucket_length(2 * mem_turns, 8)
    ex = cfg.execution
    scoring_rows = min(all_rows, ex.scoring_chunk_rows or DEFAULT_CHUNK_ROWS)  # as MemoryRewardScorer chunks
    # the slot cache: one slot per trajectory, prefill rows of prefill_chunk

    rows, cache_len = num_slots(ro, traj), slot_cache_size(ro.max_context_tokens)
    prompt = min(ro.prefill_chunk, cache_len)
    return {"rollout_rows": rows, "prompt_len": prompt, "cache_len": cache_len,
            "train_len": train_len, "micro_batch_rows": ex.micro_batch_rows,
            "logprob_rows": ex.logprob_chunk_rows, "scoring_rows": scoring_rows, "scoring_len": scoring_len,
            "logit_chunk": ex.logit_chunk_tokens}


class _Act:
    """Per-device element counts of activations, sharded by the logical-axis rules."""

    def __init__(self, model_cfg, mesh, rules, dense_max_len: int):
        self.c, self.mesh, self.rules = model_cfg, mesh, rules
        self.act = model_cfg.activation_dtype.itemsize
        self.dense_max_len = dense_max_len  # ExecutionConfig.dense_attention_max_len

    def elems(self, axes, shape) -> int:
        from jax.sharding import NamedSharding

        spec = logical_to_spec(axes, self.rules, self.mesh.shape, shape)
        return math.prod(NamedSharding(self.mesh, spec).shard_shape(tuple(shape)))

    def width(self, rows, length, name, size) -> int:
        return self.elems(("batch", "seq", name), (rows, length, size))

    def heads(self, rows, length, name, heads) -> int:
        return self.elems(("batch", "seq", name, "head_dim"), (rows, length, heads, self.c.head_dim))

    def blocked(self, length, slots) -> bool:
        """Whether ``length`` queries over ``slots`` keys take the blocked attention
        (``attention_xla.use_blocked`` at ``ExecutionConfig.dense_attention_max_len``)."""

        return use_blocked(length, slots, min_len=self.dense_max_len)

    def scores(self, rows, length, slots, saved: bool = False) -> int:
        """Elements of the attention scores live at once: ``[rows, heads, length, slots]`` on the
        dense path; on the blocked path one ``BLOCK_Q x BLOCK_K`` tile per row and head, or with
        ``saved`` (the backward pass, which rematerialises one query block at a time) that query
        block's scores over every key, ``BLOCK_Q x slots``."""

        if self.blocked(length, slots):
            length, slots = min(length, BLOCK_Q), (slots if saved else min(slots, BLOCK_K))
        return self.elems(("batch", "heads", "seq", None), (rows, self.c.num_heads, length, slots))

    def logits(self, rows, length) -> int:
        return self.elems(("batch", "seq", "vocab"), (rows, length, self.c.vocab_size))

    def head(self) -> int:
        """Bytes of the LM-head matrix as its matmul reads it: the embedding table (tied) or the head
        in the activation dtype, gathered whole over ``fsdp`` and split over ``tensor`` like the
        logits; a cast or transposed copy of the stored matrix, or the gathered one on an fsdp mesh."""
        return self.act * self.elems(("vocab", None), (self.c.vocab_size, self.c.embed_dim))

    def layer_forward(self, rows, length, slots, attention_bytes: int = ATTENTION_BYTES) -> int:
        """Live bytes at the peak of one layer's forward in a scan over the layers (nothing kept
        for a backward pass): the larger of its two stages. The MLP stage holds the residual
        stream, the gate, the up projection and their product; the attention stage the residual
        stream and the normalised input, q / k / v, the rotated queries (on the blocked path also
        the queries and the output laid out in blocks) and ``attention_bytes`` per element of the
        ``[rows, heads, length, slots]`` scores (``scores``)."""
        c, a = self.c, self.act
        residual, mlp = self.width(rows, length, "embed", c.embed_dim), self.width(rows, length, "mlp", c.mlp_dim)
        queries = 3 + (2 if self.blocked(length, slots) else 0)
        attention = (a * (2 * residual + queries * self.heads(rows, length, "heads", c.num_heads)
                          + 2 * self.heads(rows, slots, "kv_heads", c.num_kv_heads))
                     + attention_bytes * self.scores(rows, length, slots))
        return max(a * (residual + 3 * mlp), attention)

    def layer_saved(self, rows, length) -> int:
        """Bytes one layer keeps for the backward pass: residual and normalised inputs (and their
        float32 norm statistics), q / k / v before and after RoPE, attention output, the attention
        buffers, the SwiGLU gate, up, activation and product."""
        c, a = self.c, self.act
        per_score = SAVED_BLOCKED_ATTENTION_BYTES if self.blocked(length, length) else SAVED_ATTENTION_BYTES
        return (a * (6 * self.width(rows, length, "embed", c.embed_dim)
                     + 3 * self.heads(rows, length, "heads", c.num_heads)
                     + 3 * self.heads(rows, length, "kv_heads", c.num_kv_heads)
                     + 4 * self.width(rows, length, "mlp", c.mlp_dim))
                + 8 * self.width(rows, length, "embed", c.embed_dim)
                + per_score * self.scores(rows, length, length, saved=True))


def build_plan(cfg, mesh_cfg, tpu, plan_cfg) -> MemoryPlan:
    """The ``MemoryPlan`` of an ``ExperimentConfig`` on ``tpu`` with ``mesh_cfg`` (no devices used).

    Args:
      cfg: ``ExperimentConfig`` (model, RL optimizer, rollout sizes).
      mesh_cfg: ``MeshConfig`` (axis sizes, ``-1`` filled from the slice's device count; rules).
      tpu: ``TPUConfig`` (device count and HBM).
      plan_cfg: ``PlanConfig`` (prompt / answer bounds, HBM fraction); the micro-batch and chunk rows are
        ``cfg.execution``'s.

    Raises:
      ValueError: a mesh that does not match the device count, or an unknown preset.
    """
    import jax

    mesh = mesh_cfg.abstract(tpu.num_devices)
    rules = mesh_cfg.rules
    model_cfg = cfg.lora.model_config(model_config(cfg, mesh, rules))  # LoraConfig: adapters, base dtype
    _, abstract = split_model(abstract_model(model_cfg))  # nnx.eval_shape of the Decoder
    ps = param_shardings(abstract, mesh, rules)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, ps)
    optimizer = make_optimizer(cfg.optim)
    # LoRA: the optimizer state, gradients and reference copy are the adapters' (the base is frozen
    # and shared by the reference); without adapters the trainable part is every parameter.
    trainable, t_shardings = split_trainable(params)[0], split_trainable(ps)[0]
    os_ = opt_state_shardings(optimizer, split_trainable(abstract)[0], mesh, rules)
    opt_state = jax.eval_shape(jax.jit(optimizer.init, in_shardings=(t_shardings,), out_shardings=os_), trainable)
    shapes = step_shapes(cfg, plan_cfg)
    rows, size = shapes["rollout_rows"], shapes["cache_len"]
    cache = jax.eval_shape(jax.jit(lambda: init_cache(model_cfg, rows, size),
                                   out_shardings=cache_shardings(model_cfg, rows, size, mesh, rules)))

    p_bytes, o_bytes, c_bytes = _sharded_bytes(params), _sharded_bytes(opt_state), _sharded_bytes(cache)
    t_bytes = _sharded_bytes(trainable)
    act = _Act(model_cfg, mesh, rules, cfg.execution.dense_attention_max_len)
    n_layers = model_cfg.num_layers
    prompt, train_len = shapes["prompt_len"], shapes["train_len"]
    micro, lp_rows = shapes["micro_batch_rows"], shapes["logprob_rows"]
    s_rows, s_len = shapes["scoring_rows"], shapes["scoring_len"]
    gradient_bytes = 2 * t_bytes  # accumulator + one micro-batch's gradient (trainable parameters' dtype)
    chunk = shapes["logit_chunk"]
    # Every pass scans the layers as the decoder stores them (stacked: no copy). Weights an fsdp
    # mesh shards at rest are gathered (split over tensor only) for their matmuls, one layer at a
    # time, and the embedding / LM head are held whole (the update also their gradients:
    # EMBEDDING_COPIES).
    gathered_all = _gathered_bytes(abstract, ps, mesh, rules)
    w_size = model_cfg.weight_dtype.itemsize
    embedding = w_size * act.elems((None, "vocab", None), (1, model_cfg.vocab_size,
                                                                                    model_cfg.embed_dim))
    heads = embedding * (1 if model_cfg.tie_embeddings else 2)
    # one layer's gathered weights (the head's matrix is the passes' "head" term)
    forward_weights = (gathered_all - heads) // max(n_layers, 1) if gathered_all else 0
    # an fsdp mesh that stores the head wider than the activations gathers it in its stored dtype
    # and casts it: both copies are live at once, before the layers run
    gather_stage = forward_weights + act.head() + (embedding if gathered_all and w_size != act.act else 0)
    embedding_copies = EMBEDDING_COPIES if gathered_all else 2  # unsharded: the two gradients only
    if cfg.execution.remat == "none":  # every layer's saved activations + two layers' backward transients
        saved = (n_layers + 2) * act.layer_saved(micro, train_len)
    else:  # each layer's input and the recomputed layer's saved activations
        saved = (n_layers * act.act * act.width(micro, train_len, "embed", model_cfg.embed_dim)
                 + act.layer_saved(micro, train_len))
    # The sampler's copy of the weights while the rollout runs: in bfloat16 (ExecutionConfig.rollout_dtype)
    # the weight sync's cast copy of float32 weights; otherwise it samples from the policy's own arrays
    rollout_copy = p_bytes * 2 // w_size if cfg.execution.rollout_dtype == "bfloat16" and w_size != 2 else 0
    def forward_terms(logits: int, layer: int) -> dict:
        """A forward-only pass (log-probs, scoring): held together, as XLA's buffer packing of the
        layer scan and the LM-head scan leaves them; ``gather`` is what the head's gather stage
        holds beyond that, where it does."""
        held = {"weights": forward_weights, "head": act.head(), "logits": logits, "layer": layer}
        return {**held, "gather": max(gather_stage - sum(held.values()), 0)}

    terms = {  # float32 logits copies per phase: LOGIT_COPIES
        "sampling": {"kv_cache": c_bytes, "logits": LOGIT_COPIES["sampling"] * 4 * act.logits(rows, prompt),
                     "layer": act.layer_forward(rows, prompt, size, SAMPLER_ATTENTION_BYTES),
                     "rollout_weights": rollout_copy},
        "logprobs": forward_terms(LOGIT_COPIES["logprobs"] * 4 * act.logits(lp_rows, min(chunk, train_len)),
                                  act.layer_forward(lp_rows, train_len, train_len)),
        "scoring": forward_terms(LOGIT_COPIES["scoring"] * 4 * act.logits(s_rows, min(chunk, s_len // ANSWER_FRACTION)),
                                 act.layer_forward(s_rows, s_len, s_len)),
        "update": {"gradients": gradient_bytes, "embedding": embedding_copies * embedding, "saved": saved,
                   "logits": LOGIT_COPIES["update"] * 4 * act.logits(micro, min(chunk, train_len))},
    }
    phases = {phase: sum(t.values()) for phase, t in terms.items()}
    shapes["gradient_bytes"] = gradient_bytes
    # the reference copies the trainable part (float32; bfloat16 with ExecutionConfig.reference_dtype); LoRA shares the base
    ref_bytes = t_bytes // 2 if cfg.execution.reference_dtype == "bfloat16" else t_bytes
    peak = p_bytes + ref_bytes + o_bytes + max(phases.values())
    mesh_shape = dict(zip(("data", "fsdp", "tensor"), mesh_cfg.shape(tpu.num_devices)))
    shapes["num_heads"], shapes["num_kv_heads"] = model_cfg.num_heads, model_cfg.num_kv_heads
    return MemoryPlan(model_source(cfg), model_cfg.num_params(), tpu.accelerator_type, tpu.chip.name,
                      tpu.num_devices, tpu.hbm_bytes, mesh_shape, p_bytes, o_bytes, ref_bytes, c_bytes, phases,
                      terms, shapes, peak, int(plan_cfg.hbm_fraction * tpu.hbm_bytes))


TRAINING_PROGRAMS = ("update", "logprobs", "scoring")  # what ``xla_phases`` compiles (``--xla``)


def _memory(compiled) -> dict:
    """``compiled.memory_analysis()`` as ``{"arguments", "temporaries", "outputs", "aliased", "total"}``
    bytes per device, ``total`` = arguments + temporaries + outputs − aliased."""
    m = compiled.memory_analysis()
    d = {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes,
         "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes}
    d["total"] = d["arguments"] + d["temporaries"] + d["outputs"] - d["aliased"]
    return d


def eval_slots(cfg, tpu) -> int | None:
    """KV-cache slots of an evaluation rollout on one host (``run.stages``: ``EvalConfig.num_slots``,
    else one per held-out question of the host, bucketed as ``engine.num_slots``); ``None`` when
    ``EvalConfig.num_questions`` is 0 (every held-out question: a count the recipe does not fix)."""

    ro = cfg.rl.rollout
    if cfg.eval.num_slots:
        return int(cfg.eval.num_slots)
    if not cfg.eval.num_questions:
        return None
    hosts = max(tpu.num_devices // chips_per_host(tpu), 1)
    return num_slots(ro, -(-cfg.eval.num_questions // hosts))


def phase_programs(cfg, mesh_cfg, tpu, plan_cfg, devices=None) -> dict:
    """Every program a run of ``cfg`` compiles, built as the run builds it, at the plan's shapes
    (``step_shapes``), with abstract parameters (nothing allocated): ``{name: () -> jax.stages.Lowered}``
    (each lowered when called).

    * ``update``: the PPO step (``TrainSteps.lower_ppo``) on one micro-batch of ``micro_batch_rows`` x
      ``train_len`` packed rows; ``sft``: the SFT step (``TrainSteps.lower_sft``) on
      ``sft_micro_batch_rows`` (when SFT runs);
    * ``logprobs``: the packed log-prob pass of the reference / old log-probs (``TrainSteps.logprobs``);
    * ``scoring``: the memory-reward scorer's packed pass (``MemoryRewardScorer.packed_logprobs``);
    * ``prefill`` / ``decode``: the slot sampler's ``extend`` at the largest prefill call
      (``engine.extend_shapes``) and its ``decode`` chunk over every slot, on the rollout mesh of
      one host's first devices (``core.rollout_mesh``), parameters in ``ExecutionConfig.rollout_dtype``;
    * ``eval_prefill`` / ``eval_decode``: the same at the evaluation's slot count (``eval_slots``),
      when it differs from the rollout's.

    The mesh is ``mesh_cfg``'s over ``devices`` (default this process's ``jax.devices()``; a TPU
    slice's compile-only devices: ``run.aot.slice_devices``), the model ``model_config`` with
    ``cfg.lora``'s adapters.

    Raises:
      ValueError: fewer devices than the slice has; as ``model_config``.
    """
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    n = tpu.num_devices
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"the programs of {tpu.accelerator_type} need {n} devices, there are {len(devices)} "
                         f"(CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    mesh = make_mesh(*mesh_cfg.shape(n), devices=devices[:n])
    rules = mesh_cfg.rules
    model_cfg = cfg.lora.model_config(model_config(cfg, mesh, rules))
    graphdef, abstract = split_model(abstract_model(model_cfg))
    ex = cfg.execution
    fn = make_logits_fn(graphdef, mesh=mesh, rules=rules, **ex.forward_options)
    steps = TrainSteps(fn, make_optimizer(cfg.optim), abstract, mesh=mesh, rules=rules)
    train_state = steps.init(abstract)  # abstract, with the run's shardings
    s = step_shapes(cfg, plan_cfg)
    bs = steps.batch_sharding
    sds = lambda r, length, dt: jax.ShapeDtypeStruct((r, int(length)), dt, sharding=bs)  # noqa: E731
    length = s["train_len"]
    programs = {"update": lambda: steps.lower_ppo(train_state, s["micro_batch_rows"], length, 1, LossConfig())}
    if cfg.sft.steps > 0:
        sft_rows = ex.sft_micro_batch_rows or ex.micro_batch_rows
        programs["sft"] = lambda: steps.lower_sft(train_state, sft_rows, length, 1)
    programs["logprobs"] = lambda: steps.logprobs.lower(train_state.params, s["logprob_rows"], length)
    scorer = MemoryRewardScorer(fn, 0, [1], batch_sharding=bs, param_shardings=steps.param_shardings)
    r, sl = s["scoring_rows"], s["scoring_len"]
    programs["scoring"] = lambda: scorer.packed_logprobs.lower(train_state.params, *[sds(r, sl, jnp.int32)] * 3,
                                                               *[sds(r, sl // ANSWER_FRACTION, jnp.int32)] * 2)

    # the rollout: one host's rollout mesh, as experiment.make_policy builds it
    ro = cfg.rl.rollout
    host = [d for d in devices[:n] if d.process_index == devices[0].process_index][:chips_per_host(tpu)]
    local = rollout_mesh(make_mesh(len(host), 1, 1, devices=host), model_cfg.num_heads, model_cfg.num_kv_heads,
                         mesh_cfg.rollout_tensor)
    sampler = SlotSampler(graphdef, model_cfg, (), 0, mesh=local, rules=rules, param_dtype=ex.rollout_param_dtype,
                          attention_impl=ex.attention_impl)
    size = sampler.cache_size(ro.max_context_tokens)
    rep = NamedSharding(local, PartitionSpec())
    floating = lambda a: sampler.param_dtype if sampler.param_dtype and jnp.issubdtype(a.dtype, jnp.floating) else a.dtype  # noqa: E731
    rparams = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, floating(a), sharding=sh), abstract,
                           sampler.param_shardings)
    scalar = lambda dt, shape=(): jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
    greedy = {"rollout": ro.temperature == 0.0, "eval": cfg.eval.temperature == 0.0}

    def state(slots):
        shapes = jax.eval_shape(lambda: sampler.init_state(slots, size, ro.max_new_tokens))
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                            sampler.state_shardings(slots, size))

    def prefill(slots, which):
        rows, width = max(extend_shapes(ro, slots))
        st = state(slots)
        i32 = functools.partial(scalar, jnp.int32)
        return sampler._program("extend", st).lower(
            rparams, st, i32((rows,)), i32((rows, width)), i32((rows,)), i32((rows,)), scalar(jnp.bool_, (rows,)),
            i32((rows,)), i32((rows,)), key, scalar(jnp.float32), scalar(jnp.float32), greedy=greedy[which],
            use_top_p=False)

    def decode(slots, which):
        st = state(slots)
        return sampler._program("decode", st).lower(rparams, st, key, scalar(jnp.float32), scalar(jnp.float32),
                                                    rows=None, steps=ro.decode_chunk, greedy=greedy[which],
                                                    use_top_p=False)

    slots = num_slots(ro, -(-cfg.rl.questions_per_step // max(n // chips_per_host(tpu), 1)) * cfg.rl.group_size)
    programs["prefill"] = functools.partial(prefill, slots, "rollout")
    programs["decode"] = functools.partial(decode, slots, "rollout")
    evaluation = eval_slots(cfg, tpu)
    if evaluation and evaluation != slots:
        programs["eval_prefill"] = functools.partial(prefill, evaluation, "eval")
        programs["eval_decode"] = functools.partial(decode, evaluation, "eval")
    return programs


def xla_phases(cfg, mesh_cfg, tpu, plan_cfg, devices=None) -> dict:
    """XLA's own ``compiled.memory_analysis()`` per device of the update, log-prob and scoring
    programs (``phase_programs``) on a mesh of ``devices`` (default this process's devices,
    shaped like the slice's; on CPU: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

    Returns:
      ``{phase: {"arguments", "temporaries", "outputs", "aliased"}}`` bytes, and for each phase
      ``"total"`` = arguments + temporaries + outputs − aliased (the donated parameters and
      optimizer state of the update are counted once).

    Raises:
      ValueError: fewer devices than the slice has.
    """
    programs = phase_programs(cfg, mesh_cfg, tpu, plan_cfg, devices)
    return {phase: _memory(programs[phase]().compile()) for phase in TRAINING_PROGRAMS}


def phase_totals(plan: MemoryPlan) -> dict:
    """The plan's bytes per device of the programs ``xla_phases`` compiles: what each holds
    (parameters; the update also the optimizer state) plus its transient phase term."""
    return {"update": plan.params + plan.opt_state + plan.phases["update"],
            "logprobs": plan.params + plan.phases["logprobs"],
            "scoring": plan.params + plan.phases["scoring"]}


def program_plan_bytes(plan: MemoryPlan, rollout: dict, eval_rollout: dict | None = None) -> dict:
    """The plan's bytes per device of each ``phase_programs`` program: ``phase_totals``; ``sft`` as
    the update (the plan's update phase covers SFT); ``prefill`` the rollout mesh's parameters and
    KV cache (``rollout_plan``) plus the sampling phase's logits and layer terms; ``decode`` the
    parameters and cache alone; ``eval_*`` the same with ``eval_rollout``'s cache."""
    out = dict(phase_totals(plan))
    out["sft"] = out["update"]
    transient = plan.terms["sampling"]["logits"] + plan.terms["sampling"]["layer"]
    for prefix, r in (("", rollout), ("eval_", eval_rollout)):
        if r is not None:
            out[f"{prefix}prefill"] = r["per_device_bytes"] + transient
            out[f"{prefix}decode"] = r["per_device_bytes"]
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def _terms(terms: dict) -> str:
    """``terms`` as ``name GiB`` pairs, the non-zero ones, largest first."""
    return ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v)


def format_plan(plan: MemoryPlan, source: str = "") -> str:
    """The plan as a table of GiB per device (what the command prints)."""
    s = plan.shapes
    m = plan.mesh
    lines = [
        f"MemPO memory plan{' — ' + source if source else ''}",
        f"  model    {plan.model}: {plan.num_params / 1e9:.2f} B parameters",
        f"  slice    {plan.accelerator}: {plan.num_devices} devices ({plan.chip}, {plan.hbm_bytes / GIB:.0f} GiB HBM each)"
        f", mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}",
        f"  shapes   rollout {s['rollout_rows']} rows x {s['cache_len']} cache slots (prompt {s['prompt_len']}); "
        f"update micro-batch {s['micro_batch_rows']} x {s['train_len']}; log-probs {s['logprob_rows']} x "
        f"{s['train_len']}; scoring {s['scoring_rows']} x {s['scoring_len']}",
        "  per device:",
        f"    parameters (policy)        {_gib(plan.params)}",
        f"    optimizer state            {_gib(plan.opt_state)}",
        f"    reference parameters       {_gib(plan.reference)}",
        f"    KV cache (sampler)         {_gib(plan.kv_cache)}",
        f"    activations (peak phase)   {_gib(plan.activations)}",
        f"    gradients (update)         {_gib(s['gradient_bytes'])}",
        "  phases (transient, per device):",
    ]
    lines += [f"    {name:<26} {_gib(value)}  ({_terms(plan.terms[name])}){'   <- peak' if name == plan.peak_phase else ''}"
              for name, value in plan.phases.items()]
    t = m["tensor"]
    if s["num_heads"] % t or s["num_kv_heads"] % t:
        lines.append(f"  note     tensor={t} does not divide the {s['num_heads']} query / {s['num_kv_heads']} KV heads: "
                     f"attention runs replicated over tensor, with more memory than planned")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  peak {_gib(plan.peak)} of budget {plan.budget / GIB:.2f} GiB "
                 f"({plan.budget / plan.hbm_bytes:.0%} of {plan.hbm_bytes / GIB:.0f} GiB): {verdict} "
                 f"({plan.peak / plan.hbm_bytes:.0%} of HBM)")
    return "\n".join(lines)


def plan_dict(plan: MemoryPlan) -> dict:
    """JSON-able dict of the plan (bytes), with ``fits``, ``activations`` and ``peak_phase``."""
    d = dataclasses.asdict(plan)
    d.update(fits=plan.fits, activations=plan.activations, peak_phase=plan.peak_phase)
    return d


# ---------------------------------------------------------------- rollout: per-host mesh and weight sync


def chips_per_host(tpu) -> int:
    """Chips (JAX devices) of one TPU VM host: a slice of at most 8 chips is one host (v5e / v6e),
    larger slices and every v5p slice have 4 chips per host (Cloud TPU "System architecture")."""
    n = tpu.num_devices
    return n if n <= 8 and tpu.chip.name != "v5p" else min(4, n)


def rollout_plan(cfg, mesh_cfg, tpu, plan_cfg) -> dict:
    """Each host's rollout (``core.rollout_mesh``): its mesh, slots, per-device bytes and weight sync.

    Every host rolls out ``questions_per_step / hosts`` questions on a ``(data, 1, tensor)`` mesh of
    its own chips (``MeshConfig.rollout_tensor``, 0: the most chips dividing the heads), holding
    the whole model over ``tensor`` chips and its slots' KV cache over all of them; once per step
    the weights are all-gathered from the training layout (every chip receives the whole model).

    Returns:
      ``{"hosts", "chips_per_host", "mesh": {data, fsdp, tensor}, "slots", "cache_len",
      "params_bytes", "cache_bytes", "sync_bytes", "per_device_bytes", "fits"}`` (bytes per chip
      except ``sync_bytes``, the parameter bytes each chip receives in the weight sync).
    """

    model_cfg = cfg.lora.model_config(model_config(cfg))  # LoraConfig: the base dtype, float32 adapters
    host = chips_per_host(tpu)
    hosts = max(tpu.num_devices // host, 1)
    heads, kv = model_cfg.num_heads, model_cfg.num_kv_heads
    tensor = mesh_cfg.rollout_tensor or max(t for t in range(1, host + 1) if host % t == 0 and heads % t == 0 and kv % t == 0)
    questions = -(-cfg.rl.questions_per_step // hosts)
    ro = cfg.rl.rollout
    slots, size = num_slots(ro, questions * cfg.rl.group_size), slot_cache_size(ro.max_context_tokens)
    bf16 = cfg.execution.rollout_dtype == "bfloat16"  # the weight sync casts every floating parameter
    p_bytes = (model_cfg.num_params() * (2 if bf16 else model_cfg.weight_dtype.itemsize)
               + model_cfg.num_lora_params() * (2 if bf16 else 4))
    c_bytes = 2 * model_cfg.num_layers * slots * kv * size * model_cfg.head_dim * model_cfg.activation_dtype.itemsize
    per_device = p_bytes // tensor + c_bytes // host
    return {"hosts": hosts, "chips_per_host": host, "mesh": {"data": host // tensor, "fsdp": 1, "tensor": tensor},
            "slots": slots, "cache_len": size, "params_bytes": p_bytes // tensor, "cache_bytes": c_bytes // host,
            "sync_bytes": p_bytes, "per_device_bytes": per_device,
            "fits": per_device <= tpu.hbm_bytes * plan_cfg.hbm_fraction}


def format_rollout_plan(r: dict) -> str:
    """``rollout_plan`` as the lines the command prints."""
    m = r["mesh"]
    return "\n".join([
        f"  rollout  per host ({r['hosts']} hosts x {r['chips_per_host']} chips): mesh data={m['data']} fsdp=1 "
        f"tensor={m['tensor']} (MeshConfig.rollout_tensor), {r['slots']} slots x {r['cache_len']} positions",
        f"    parameters {_gib(r['params_bytes'])} + KV cache {_gib(r['cache_bytes'])} = {_gib(r['per_device_bytes'])} "
        f"per chip: {'fits' if r['fits'] else 'DOES NOT FIT (bind a larger MeshConfig.rollout_tensor)'}",
        f"    weight sync once per step: all-gather of {_gib(r['sync_bytes'])} into each chip",
    ])


def fit_error(plan: MemoryPlan) -> str:
    """The one-line message for a plan whose peak exceeds its budget: the peak, the budget, the
    largest phase and its terms, and what to change."""
    return (f"the plan does not fit: peak {plan.peak / GIB:.2f} GiB per device > budget "
            f"{plan.budget / GIB:.2f} GiB ({plan.budget / plan.hbm_bytes:.0%} of the {plan.hbm_bytes / GIB:.0f} GiB "
            f"HBM of a {plan.chip} chip); the largest phase is '{plan.peak_phase}' "
            f"({plan.phases[plan.peak_phase] / GIB:.2f} GiB: {_terms(plan.terms[plan.peak_phase])}). Use more chips, "
            f"a larger fsdp/tensor split, fewer rollout rows, shorter contexts, or smaller micro-batch / chunk rows.")


def format_xla_comparison(xla: dict, plan: MemoryPlan) -> str:
    """``xla_phases``' totals per phase beside the plan's (``phase_totals``), one line each."""
    ours = phase_totals(plan)
    lines = ["  XLA memory_analysis() per device (arguments + temporaries + outputs - aliased) against the plan:"]
    for phase, d in xla.items():
        lines.append(f"    {phase:<10} XLA {_gib(d['total'])} (temporaries {_gib(d['temporaries'])})   plan "
                     f"{_gib(ours[phase])}   plan / XLA {ours[phase] / max(d['total'], 1):.2f}")
    return "\n".join(lines)
