"""The dimension names of the array hints in ``model/``, ``core/`` and ``rl/``.

Array arguments and results carry jaxtyping hints, e.g. ``Float[Array, "rows length vocab"]``
(a float ``jax.Array`` of shape ``[rows, length, vocab]``), ``Int[Array, "rows length"]``,
``Bool[Array, "rows length"]``; ``Shaped[...]`` where any dtype is accepted (masks given as bool or
{0, 1} floats), ``np.ndarray`` in place of ``Array`` for host arrays, ``ArrayLike`` where either is
accepted. A name stands for one size throughout a call: ``logits: Float[Array, "rows length
vocab"]`` with ``input_ids: Int[Array, "rows length"]`` states that both have the same rows and
length. ``*batch`` is any number of dimensions (the same ones throughout the call), ``...`` any
number not compared, ``_`` one dimension not compared, ``{block}`` the value of the argument
``block``.

The hints are checked at each call (shapes, dtypes and every other hint) while the tests run
(``tests/conftest.py`` installs jaxtyping's import hook with beartype); a product run does not check
them.

Names:

=================  ============================================================================
``rows``           rows of a batch: token sequences (padded, or packed end to end)
``length``         token positions of a row (sequence length, padded to a bucket)
``keys``           key positions attended to (``length`` without a KV cache)
``positions``      selected positions per row (``logits_at``: the answer tokens of packed rows)
``packed``         rows of a packed batch (``core.packing``)
``chunk``          positions of one LM-head chunk (``core.logprobs``)
``vocab``          vocabulary entries (the logits' last dimension)
``embed``          model width (hidden states, embeddings)
``heads``          query heads
``kv_heads``       key/value heads (grouped-query attention: ``heads`` is a multiple)
``head_dim``       features per attention head; ``half_head_dim`` its half (RoPE frequencies)
``layers``         decoder layers
``slots``          KV-cache slots (one context each)
``cache``          positions of a KV-cache slot
``rank``           LoRA rank
``trajectories``   rollouts of a step, one outcome reward each
``turns``          ``<mem>`` turns (spans) scored for the memory reward
``entries``        values of a group statistic (``trajectories`` or ``turns``)
``processes``      JAX processes of a multi-host run
=================  ============================================================================
"""
