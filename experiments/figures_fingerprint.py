"""Fingerprints of the figures of a fixed set of programs, before and after a change.

A refactor that should leave every figure alone (renames, tables re-keyed,
code moved between modules) is checked by running this on the commit before
it and on the commit after, and comparing the two outputs line by line::

    python -m experiments.figures_fingerprint > before.txt
    ... change ...
    python -m experiments.figures_fingerprint > after.txt
    diff before.txt after.txt

Each line is one program lowered at 16 tiles: its name, the figures'
fingerprint (:func:`experiments.program_figures.figures_sha1`: every step's cycles
and bytes received per tile, every tile's peak memory), a fingerprint of the
vertex types each step runs, and the code bytes summed over tiles. The
programs are the fuzz programs of ``tests/program_generator.py`` for
``--seeds`` seeds, and a few programs per rule family (elementwise,
reductions, scans, linear algebra, collectives with a matmul's partials).
"""

from __future__ import annotations

import hashlib
import os
import sys

from absl import app
from absl import flags

# Four host devices, for the pmapped collective (before JAX starts).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
import jax  # pylint: disable=wrong-import-position
from jax import lax
import jax.numpy as jnp
import numpy as np

_SEEDS = flags.DEFINE_integer("seeds", 30, "fuzz programs: seeds 0 .. seeds - 1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rand(seed, shape, dtype=np.float32):
  return np.random.default_rng(seed).uniform(-2, 2, shape).astype(dtype)


def _spd(seed, n, batch=()):
  a = _rand(seed, batch + (n, n))
  return a @ np.swapaxes(a, -1, -2) + n * np.eye(n, dtype=np.float32)


def _family_programs():
  """(name, fn, args) of a few programs per rule family."""
  x = _rand(0, (37, 21))
  xi = np.random.default_rng(1).integers(-40, 40, (37, 21)).astype(np.int32)
  programs = [
      ("elementwise_f32", lambda a: (jnp.exp(a) * jnp.tanh(a) - lax.rsqrt(jnp.abs(a) + 1),
                                     a > 0.5, jnp.arctan2(a, a.T.sum())), (x,)),
      ("elementwise_f16", lambda a: jnp.log1p(jnp.abs(a)) + jnp.sin(a), (x.astype(np.float16),)),
      ("elementwise_int", lambda a: (a >> 2) ^ (a * 3) | lax.population_count(a), (xi,)),
      ("elementwise_other", lambda a: (lax.clamp(-1.0, a, 1.0), jnp.where(a > 0, a, 2 * a),
                                       jax.scipy.special.betainc(2.0, 3.0, jnp.abs(a) / 3)),
       (x,)),
      ("reductions", lambda a: (a.sum(0), a.max(1), a.min(), jnp.prod(a[:3], 1), a.argmax(0),
                                jnp.any(a > 1.9, 1), jnp.all(a > -1.9)), (x,)),
      ("reductions_int", lambda a: (a.sum(1), jnp.bitwise_xor.reduce(a, 0)), (xi,)),
      ("cumulative", lambda a: (jnp.cumsum(a, 0), jnp.cumprod(a[:5], 1), lax.cummax(a, 1),
                                lax.cummin(a, 0), lax.cumlogsumexp(a, 0, reverse=True)), (x,)),
      ("linalg_chol_solve", lambda s, b: (jnp.linalg.cholesky(s),
                                          jax.scipy.linalg.solve_triangular(s, b, lower=True)),
       (_spd(2, 9, (3,)), _rand(3, (3, 9, 4)))),
      ("linalg_lu_qr", lambda a: (jnp.linalg.solve(a, a[..., :1]), jnp.linalg.qr(a),
                                  jnp.linalg.det(a)), (_spd(4, 7, (5,)),)),
      ("linalg_eig_svd", lambda a: (jnp.linalg.eigh(a), jnp.linalg.svd(a, compute_uv=False)),
       (_spd(5, 6, (2,)),)),
      ("psum_scatter_after_matmul", jax.pmap(
          lambda a, w: lax.psum_scatter((a @ w).reshape(-1), "i", tiled=True), axis_name="i"),
       (_rand(6, (4, 16, 2048)), _rand(7, (4, 2048, 12)))),
  ]
  return programs


def _sharded_programs():
  """The replicated-tensor-sharding collectives next to a matmul with partials."""
  import ipu_jax
  replicas = 4

  def step(a, w):
    shard = ipu_jax.ops.cross_replica_reduce_scatter((a @ w).reshape(-1), replicas)
    return ipu_jax.ops.cross_replica_all_gather(shard * 2.0, replicas)

  return [("reduce_scatter_after_matmul", step, (_rand(8, (16, 2048)), _rand(9, (2048, 12))))]


def _fuzz_programs(seeds):
  sys.path.insert(0, os.path.join(_ROOT, "tests"))
  import program_generator  # pylint: disable=import-outside-toplevel
  for seed in range(seeds):
    program = program_generator.generate(seed)
    yield f"fuzz{seed}:{program.family}", program.fn, program.args


def fingerprint(lowered) -> tuple:
  """(figures_sha1, vertex types' sha1, code bytes over all tiles) of a lowered program."""
  # pylint: disable=import-outside-toplevel
  from experiments.program_figures import figures_sha1
  from ipu_jax.kernels.vocabulary import identity
  from ipu_jax.lowering.program import iter_steps
  names = hashlib.sha1()
  for node, _, _ in iter_steps(lowered.program):
    codelets = getattr(node, "codelets", None) or (node.op,)
    names.update(repr(tuple(identity(c) for c in codelets)).encode())
  code = int(np.asarray(lowered.profile.memory.by_category["code"], np.int64).sum())
  return figures_sha1(lowered.profile), names.hexdigest()[:16], code


def main(argv):
  del argv
  import ipu_jax  # pylint: disable=import-outside-toplevel
  target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
  programs = (list(_fuzz_programs(_SEEDS.value)) + _family_programs() + _sharded_programs())
  for name, fn, args in programs:
    try:
      figures, names, code = fingerprint(ipu_jax.jit(fn, target=target).lower(*args))
      print(f"{name:40s} figures={figures} codelets={names} code_bytes={code}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:40s} error={type(e).__name__}: {str(e).splitlines()[0][:80]}")
    sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
