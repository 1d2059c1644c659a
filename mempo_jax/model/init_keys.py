"""Named streams of PRNG keys for initialising a ``Decoder``.

``InitKeys(params=0, lora=key)`` is the interface the layers draw from: ``keys.params()`` returns
``fold_in(params_key, n)`` for the stream's n-th draw (n = 0, 1, …) and ``"lora" in keys`` says
whether a stream exists. The keys are those ``nnx.Rngs`` with the same seeds draws, so the weights of a
seed are the same; the count lives in Python instead of an ``nnx`` variable. Under
``nnx.eval_shape`` (shapes only, ``forward.abstract_model``) updating an ``nnx.Rngs`` counter goes
through a path where JAX formats an error message about the traced counter on every draw, and
those messages cost seconds for a 7B decoder's ~300 draws; a Python count costs nothing.
"""

from __future__ import annotations

import jax


class InitKeys:
    """Streams of init keys by name.

    Args:
      **seeds: a stream name → an ``int`` seed (``jax.random.key(seed)``) or a typed PRNG key.

    Raises:
      AttributeError: drawing from a stream that was not given (``keys.nope()``).
    """

    def __init__(self, **seeds: int | jax.Array):
        self._keys = {name: jax.random.key(s) if isinstance(s, int) else s for name, s in seeds.items()}
        self._drawn = dict.fromkeys(seeds, 0)

    def __contains__(self, stream: str) -> bool:
        return stream in self._keys

    def __getattr__(self, stream: str):
        if stream.startswith("_") or stream not in self._keys:
            raise AttributeError(f"no init-key stream {stream!r} (streams: {', '.join(self._keys)})")
        return lambda: self.draw(stream)

    def draw(self, stream: str) -> jax.Array:
        """The next key of ``stream``: ``fold_in(key, n)``, ``n`` the number drawn from it before."""
        n = self._drawn[stream]
        self._drawn[stream] = n + 1
        return jax.random.fold_in(self._keys[stream], n)
