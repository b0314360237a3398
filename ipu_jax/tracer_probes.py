"""Attribute probes of tracers that cost nothing while a large model is traced.

``jax.Array`` declares ``sharding`` and ``device``; a tracer has neither, so
reading them raises ``AttributeError`` (on purpose: ``hasattr`` and
``getattr(x, "sharding", None)`` then work as probes). In the JAX this
project pins (0.10.2), the error's message is built eagerly and ends with the
tracer's *origin*: ``find_progenitors`` walks every equation traced so far to
say which operations made the value a tracer. Flax NNX probes
``value.sharding`` on every ``Variable`` assignment (``Variable.set_value``,
``flax/nnx/variablelib.py``): each parameter a model initialises under
``nnx.eval_shape`` and each ``Rngs`` count it steps. The probe's message is
never read, yet tracing a model of ``n`` parameters walks ``O(n)``
equations ``O(n)`` times. For BERT-Large (``nnx.eval_shape`` of the model,
the runners' ``--estimate_only``) that is 1.7 s of CPU, 0.2-0.3 s without
the walk. JAX removed the walk from these two messages upstream
(jax-ml/jax pull request 40041, "Avoid quadratic tracing behaviour").

:func:`cheap_tracer_probes` does the same for the ``with`` block: a tracer's
``sharding`` and ``device`` properties raise ``AttributeError`` without
walking the trace. What a caller sees is unchanged: Python hands an
``AttributeError`` raised by a property on to the class's ``__getattr__``,
and JAX's ``Tracer.__getattr__`` raises its own error for both names (for
``sharding`` the hint to use ``jax.typeof(x)``; for ``device`` "has no
attribute device"), so the walked message was never seen. Probes give the
same answers and no traced program differs. ``ipu_jax.jit`` and
``ipu_jax.pipelining.Pipeline`` trace the user's function inside it; wrap
``nnx.eval_shape`` of a large model in it too::

    with ipu_jax.cheap_tracer_probes():
      model = nnx.eval_shape(lambda: Bert(cfg, rngs=nnx.Rngs(0)))
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from ipu_jax.lowering.jax_compat import core

__all__ = ["cheap_tracer_probes"]

# The two attributes jax.Array declares that a tracer answers by raising
# AttributeError (jax/_src/core.py, Tracer.sharding and Tracer.device).
_PROBED = ("sharding", "device")

_lock = threading.Lock()
_depth = 0
_originals: dict = {}


def _unavailable(name: str) -> property:
  """The tracer property ``name``: raises ``AttributeError`` without the origin walk."""

  def probe(self):
    # Replaced by Tracer.__getattr__'s own error (see the module docstring).
    raise AttributeError(f"The '{name}' attribute is not available on {self._error_repr()}.")

  probe.__name__ = name
  return property(probe)


@contextlib.contextmanager
def cheap_tracer_probes() -> Iterator[None]:
  """Within the block, probing a tracer's ``sharding`` or ``device`` walks nothing.

  Re-entrant and safe to nest (the properties JAX defines come back when the
  outermost block ends). The properties belong to JAX's ``Tracer`` class, so
  other threads tracing meanwhile skip the walk too; what they see is the same.
  """
  global _depth
  with _lock:
    if _depth == 0:
      for name in _PROBED:
        # A JAX that no longer defines the property on Tracer itself gets ours
        # for the block and none after it.
        _originals[name] = core.Tracer.__dict__.get(name)
        setattr(core.Tracer, name, _unavailable(name))
    _depth += 1
  try:
    yield
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0:
        for name in _PROBED:
          original = _originals.pop(name)
          if original is None:
            delattr(core.Tracer, name)
          else:
            setattr(core.Tracer, name, original)
