"""Tests of the convolution lowering (lowering/rules/convolution.py).

Every ``conv_general_dilated`` (forward, and the input- and weight-gradient
forms ``jax.grad`` emits) must give what ``jax.jit`` gives in both executor
modes; the tests also check the exchange bytes against a brute-force count
and how the available memory proportion shapes the plan.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import ipu_jax
from ipu_jax.lowering.conv_plan import conv_geometry, plan_conv
import testing_utils

_SMALL = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_FULL = ipu_jax.IPUTarget.preset("ipu2")
_NHWC = ("NHWC", "HWIO", "NHWC")


def _config(mode="batched", conv_amp=None):
  return testing_utils.executor_config(
      mode, convolutions={"available_memory_proportion": conv_amp})


_random = testing_utils.random_array


def _conv(strides=(1, 1), padding="SAME", lhs_dilation=None, rhs_dilation=None, dn=_NHWC,
          fgc=1, bgc=1, preferred=None):
  def fn(x, w):
    return lax.conv_general_dilated(x, w, strides, padding, lhs_dilation, rhs_dilation, dn,
                                    fgc, bgc, preferred_element_type=preferred)
  return fn


def _check(fn, *args, tol=1e-5, **kwargs):
  return testing_utils.assert_sums_match_jit(fn, *args, rtol=tol, **kwargs)


def _conv_steps(lowered):
  return [s for s in lowered.report.profile.steps if s.op == "conv_general_dilated"]


def _grad_convs(fn, x, w):
  """The conv equations of ``fn``'s vjp (input and weight gradients)."""
  jaxpr = jax.make_jaxpr(lambda x, w, g: jax.vjp(fn, x, w)[1](g))(x, w, fn(x, w))
  return [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]


class ConvForwardTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("same_3x3", dict(), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("valid_3x3", dict(padding="VALID"), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("stride_2", dict(strides=(2, 2)), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("dilation_2", dict(rhs_dilation=(2, 2)), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("groups_4", dict(fgc=4), (2, 9, 9, 8), (3, 3, 2, 12)),
      ("depthwise", dict(fgc=4), (2, 9, 9, 4), (3, 3, 1, 4)),
      ("depthwise_multiplier", dict(fgc=4), (2, 7, 7, 4), (3, 3, 1, 8)),
      ("1x1", dict(), (2, 9, 9, 4), (1, 1, 4, 6)),
      ("odd_spatial", dict(strides=(2, 1)), (3, 11, 7, 5), (3, 2, 5, 7)),
      ("lhs_dilation", dict(lhs_dilation=(2, 2), padding=((1, 2), (2, 1))), (2, 5, 6, 3),
       (3, 3, 3, 4)),
      ("negative_padding", dict(padding=((2, 1), (-1, 3))), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("batch_groups", dict(bgc=2, padding="VALID"), (4, 6, 6, 3), (3, 3, 3, 4)),
      ("nchw", dict(dn=("NCHW", "OIHW", "NCHW")), (3, 5, 11, 7), (6, 5, 3, 2)),
      ("conv1d", dict(strides=(2,), padding="SAME", dn=("NWC", "WIO", "NWC")), (2, 17, 3),
       (5, 3, 4)),
      ("conv3d", dict(strides=(1, 2, 1), padding="SAME", dn=("NDHWC", "DHWIO", "NDHWC")),
       (1, 5, 6, 4, 2), (3, 3, 2, 2, 3)),
  )
  def test_matches_jax(self, kwargs, x_shape, w_shape):
    _check(_conv(**kwargs), _random(x_shape, seed=1), _random(w_shape, seed=2))

  @parameterized.named_parameters(("f16", jnp.float16, 2e-2), ("bf16", jnp.bfloat16, 5e-2))
  def test_half_precision(self, dtype, tol):
    _check(_conv(), _random((2, 8, 8, 4), dtype, 3), _random((3, 3, 4, 8), dtype, 4), tol=tol)

  def test_preferred_element_type_f32_from_bf16(self):
    x, w = _random((2, 8, 8, 4), jnp.bfloat16, 5), _random((3, 3, 4, 8), jnp.bfloat16, 6)
    got = _check(_conv(preferred=jnp.float32), x, w)
    self.assertEqual(got.dtype, jnp.float32)

  def test_zero_size(self):
    _check(_conv(), jnp.ones((0, 5, 5, 3)), jnp.ones((3, 3, 3, 4)))
    got = _check(_conv(), jnp.ones((2, 5, 5, 0)), jnp.ones((3, 3, 0, 4)))
    chex.assert_trees_all_equal(got, jnp.zeros((2, 5, 5, 4)))

  def test_one_conv_on_full_target(self):
    x, w = _random((8, 32, 32, 32), seed=7), _random((3, 3, 32, 64), seed=8)
    _check(_conv(), x, w, target=_FULL)
    lowered = ipu_jax.jit(_conv(), target=_FULL).lower(x, w)
    step = _conv_steps(lowered)[0]
    self.assertGreater(np.count_nonzero(step.compute_cycles), 1000)
    macs = 8 * 32 * 32 * 64 * 9 * 32
    self.assertGreaterEqual(step.compute_phase_cycles, 2 * macs / (32 * _FULL.num_tiles))
    self.assertEqual(step.flops, 2 * macs)


class ConvGradientTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("same", dict(), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("valid_stride_2", dict(strides=(2, 2), padding="VALID"), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("stride_2_same_even", dict(strides=(2, 2)), (2, 10, 10, 3), (3, 3, 3, 5)),
      ("dilation_2", dict(rhs_dilation=(2, 2)), (2, 9, 9, 4), (3, 3, 4, 8)),
      ("groups", dict(fgc=4), (2, 9, 9, 8), (3, 3, 2, 12)),
      ("depthwise", dict(fgc=4), (2, 9, 9, 4), (3, 3, 1, 4)),
  )
  def test_lowered_gradient_convs_match(self, kwargs, x_shape, w_shape):
    eqns = _grad_convs(_conv(**kwargs), _random(x_shape), _random(w_shape))
    self.assertLen(eqns, 3)  # the forward conv, then the two gradients
    for i, eqn in enumerate(eqns):
      args = [_random(v.aval.shape, seed=10 + i + j) for j, v in enumerate(eqn.invars)]
      _check(lambda a, b, eqn=eqn: eqn.primitive.bind(a, b, **eqn.params), *args)
    # The input gradient dilates (strided forward) or the weight gradient
    # uses batch groups (grouped forward): both forms are exercised.
    params = [e.params for e in eqns]
    if kwargs.get("fgc", 1) > 1:
      self.assertTrue(any(p["batch_group_count"] > 1 for p in params))
    if kwargs.get("strides", (1, 1)) != (1, 1):
      self.assertTrue(any(p["lhs_dilation"] != (1, 1) for p in params))

  @parameterized.named_parameters(("plain", dict()), ("depthwise", dict(fgc=4)))
  def test_grad_wrt_input_and_kernel(self, kwargs):
    x = _random((2, 8, 8, 4), seed=20)
    w = _random((3, 3, 1 if kwargs else 4, 8), seed=21)
    loss = lambda x, w: jnp.sum(jnp.tanh(_conv(**kwargs)(x, w)))
    _check(jax.grad(loss, argnums=(0, 1)), x, w)

  def test_keras_cnn_conv_shapes_forward_and_grad(self):
    # Conv2D(32, 3x3) on 32x32x3 then Conv2D(64, 3x3), as in the Keras-on-IPU
    # CNN, on a 16-tile target (a small batch so activations fit).
    x = _random((4, 32, 32, 3), seed=30)
    w1, w2 = _random((3, 3, 3, 32), seed=31) * 0.3, _random((3, 3, 32, 64), seed=32) * 0.1

    def loss(params, x):
      w1, w2 = params
      h = jax.nn.relu(_conv()(x, w1))
      h = jax.nn.relu(_conv()(h, w2))
      return jnp.sum(h * h) / h.size

    _check(lambda p, x: (loss(p, x), jax.grad(loss)(p, x)), (w1, w2), x, modes=("batched",))
    _check(jax.grad(loss), (w1, w2), x, modes=("per_tile",))
    lowered = ipu_jax.jit(jax.grad(loss), target=_SMALL).lower((w1, w2), x)
    self.assertGreaterEqual(len(_conv_steps(lowered)), 4)


class ConvAccountingTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("same", _conv(), (2, 9, 9, 4), (3, 3, 4, 8), _SMALL),
      ("valid_odd", _conv(padding="VALID"), (2, 9, 7, 4), (3, 3, 4, 8), _SMALL),
      ("groups", _conv(fgc=4), (2, 9, 9, 4), (3, 3, 1, 8), _SMALL),
      ("batch_groups", _conv(bgc=2, padding="VALID"), (4, 6, 6, 3), (3, 3, 3, 4), _SMALL),
      ("nchw", _conv(dn=("NCHW", "OIHW", "NCHW")), (3, 5, 11, 7), (6, 5, 3, 2), _SMALL),
      # One image, 4x4 spatial blocks: edge blocks read only the kernel taps
      # that meet input, not padding.
      ("spatial_edges", _conv(), (1, 10, 7, 2), (4, 3, 2, 3), _SMALL),
      ("two_ipus", _conv(), (2, 9, 9, 4), (3, 3, 4, 8),
       ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)),
  )
  def test_exchange_matches_brute_force(self, fn, x_shape, w_shape, target):
    # Stride 1, no dilation: every input position in a block's window is read,
    # so the elements a block needs are where d(block)/d(input) is non-zero.
    x, w = jnp.abs(_random(x_shape, seed=40)) + 1, jnp.abs(_random(w_shape, seed=41)) + 1
    lowered = ipu_jax.jit(fn, target=target).lower(x, w)
    step = _conv_steps(lowered)[0]
    lhs, rhs = lowered.inputs
    out = lowered.outputs[0]
    # A split contraction (``.kGIxGT``): tile ``b * gk + j`` needs what output
    # block ``b`` reads through input-channel block ``j // gt`` and kernel-row
    # block ``j % gt`` (a masked kernel's vjp).
    gi, gt = (int(v) for v in step.name.split(".k")[1].split()[0].split("x")) \
        if ".k" in step.name else (1, 1)
    gk = gi * gt
    bi, bt = -(-w.shape[2] // gi), -(-w.shape[0] // gt)  # HWIO
    rows = out.mapping.element_row // gk
    bytes_in = np.zeros(target.num_tiles, np.int64)
    needed_by = {}
    for r, tile in enumerate(out.mapping.tiles):
      ci, ct = divmod(r % gk, gt)
      mask = np.zeros(w.shape, np.float32)
      mask[ct * bt:(ct + 1) * bt, :, ci * bi:(ci + 1) * bi] = 1
      _, vjp = jax.vjp(lambda x, w: fn(x, w * mask), x, w)
      grads = vjp(jnp.asarray((rows == r // gk).reshape(out.shape), jnp.float32))
      for tensor, grad in zip((lhs, rhs), grads):
        ids = np.nonzero(np.asarray(grad).ravel())[0]
        bytes_in[tile] += 4 * int((tensor.mapping.element_tile[ids] != tile).sum())
        for e in ids:
          needed_by.setdefault((tensor.id, int(e)), set()).add(int(tile))
    bytes_out = np.zeros(target.num_tiles, np.int64)
    for (tid, e), dst in needed_by.items():
      src = int((lhs if tid == lhs.id else rhs).mapping.element_tile[e])
      bytes_out[src] += 4 * bool(dst - {src})
    np.testing.assert_array_equal(step.exchange_bytes_in, bytes_in)
    np.testing.assert_array_equal(step.exchange_bytes_out, bytes_out)

  def test_nothing_moves_on_one_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    lowered = ipu_jax.jit(_conv(), target=target).lower(jnp.ones((2, 6, 6, 3)),
                                                          jnp.ones((3, 3, 3, 4)))
    self.assertEqual(int(_conv_steps(lowered)[0].exchange_bytes_in.sum()), 0)
    self.assertGreater(lowered.report.total_cycles, 0)

  def test_lower_memory_proportion_gives_less_memory_not_fewer_cycles(self):
    # 8 x 112x112x32 -> 512 features, 3x3: the fastest grid needs more memory
    # per tile than a slower one.
    geo = conv_geometry((8, 112, 112, 32), (3, 3, 32, 512), (8, 112, 112, 512),
                        ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)), (1, 1), ((1, 1), (1, 1)),
                        (1, 1), (1, 1), 1, 1, 4, 4)
    plans = [plan_conv(_FULL, geo, amp) for amp in (0.6, 0.3, 0.1, 0.03)]
    self.assertTrue(plans[0].fits)
    self.assertNotEqual(plans[0].label, plans[-1].label)
    for high, low in zip(plans, plans[1:]):
      self.assertLessEqual(low.temp_bytes, high.temp_bytes)
      self.assertGreaterEqual(low.cycles, high.cycles)
    self.assertGreater(plans[0].num_tiles, 1000)

  def test_spatial_axes_are_split_for_a_single_image(self):
    geo = conv_geometry((1, 224, 224, 64), (3, 3, 64, 64), (1, 224, 224, 64),
                        ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)), (1, 1), ((1, 1), (1, 1)),
                        (1, 1), (1, 1), 1, 1, 4, 4)
    plan = plan_conv(_FULL, geo, 0.6)
    self.assertTrue(plan.fits)
    self.assertGreater(plan.num_tiles, 1000)
    self.assertGreater(plan.grid[2] * plan.grid[3], 64)

  def test_memory_proportion_reaches_the_lowering(self):
    x, w = jnp.ones((32, 8, 8, 32)), jnp.ones((3, 3, 32, 512))
    geo = conv_geometry(x.shape, w.shape, (32, 8, 8, 512), ((0, 3, 1, 2), (3, 2, 0, 1),
                        (0, 3, 1, 2)), (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), 1, 1, 4, 4)
    plans = {}
    for amp in (0.6, 0.03):
      lowered = ipu_jax.jit(_conv(), target=_FULL, config=_config(conv_amp=amp)).lower(x, w)
      plans[amp] = plan_conv(_FULL, geo, amp)
      self.assertIn(plans[amp].label, _conv_steps(lowered)[0].name)
    self.assertNotEqual(plans[0.6].label, plans[0.03].label)
    self.assertLess(plans[0.03].temp_bytes, plans[0.6].temp_bytes)


def _weight_grad_geometry(x_shape, w_shape, strides, padding, itemsize=2, acc_itemsize=4,
                          dtype="float16"):
  """The geometry of the weight-gradient convolution ``jax.grad`` emits (NHWC/HWIO)."""
  fn = _conv(strides, padding)
  x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype)
  eqn = [e for e in _grad_convs(fn, x, w) if tuple(e.outvars[0].aval.shape) == w_shape][0]
  (lhs, rhs), out, p = eqn.invars, eqn.outvars[0], eqn.params
  dn = p["dimension_numbers"]
  return conv_geometry(lhs.aval.shape, rhs.aval.shape, out.aval.shape,
                       (dn.lhs_spec, dn.rhs_spec, dn.out_spec), p["window_strides"],
                       p["padding"], p["lhs_dilation"], p["rhs_dilation"],
                       p["feature_group_count"], p["batch_group_count"], itemsize,
                       acc_itemsize, dtype)


def _forward_geometry(x_shape, w_shape, out_shape, strides, padding):
  return conv_geometry(x_shape, w_shape, out_shape, ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
                       strides, padding, (1, 1), (1, 1), 1, 1, 2, 4, "float16")


def _weight_grad(strides=(1, 1), padding="SAME"):
  """``x, g -> dL/dw`` of a 3x3 NHWC convolution (one ``conv_general_dilated``)."""
  def fn(x, g):
    w = jnp.zeros((3, 3, x.shape[-1], g.shape[-1]), x.dtype)
    return jax.vjp(lambda w: _conv(strides, padding)(x, w), w)[1](g)[0]
  return fn


class ConvContractionSplitTest(chex.TestCase, parameterized.TestCase):
  """Weight-gradient convolutions sum over batch x field: the planner splits
  that contraction over tiles (PopLibs' ``inChanSplit`` / ``kernelSplit``) and
  reduces the partials."""

  @parameterized.named_parameters(
      ("f32", jnp.float32, 1e-5, (1, 1)),
      ("f16_f32_partials", jnp.float16, 2e-2, (1, 1)),
      ("f32_strided", jnp.float32, 1e-5, (2, 2)))
  def test_weight_gradient_is_split_and_matches_jax(self, dtype, tol, strides):
    x = _random((4, 14, 14, 8), dtype)
    out_hw = 7 if strides == (2, 2) else 14
    g = _random((4, out_hw, out_hw, 8), dtype, seed=1)
    fn = _weight_grad(strides)
    _check(fn, x, g, tol=tol)
    steps = [s.name for s in _conv_steps(ipu_jax.jit(fn, target=_SMALL).lower(x, g))]
    self.assertTrue(any(".k" in name and name.endswith(" reduce") for name in steps), steps)

  def test_resnet_weight_gradient_fits_at_the_forward_rate(self):
    # 56x56, 3x3, 64 -> 64, batch 20, fp16 with fp32 partials on 1,472 tiles:
    # one tile summing 20x56x56 alone ran at a few flops/cycle; split, the
    # weight gradient runs near the forward's rate, within the tile's memory.
    fwd = plan_conv(_FULL, _forward_geometry((20, 56, 56, 64), (3, 3, 64, 64),
                                             (20, 56, 56, 64), (1, 1), ((1, 1), (1, 1))), 0.6)
    geo = _weight_grad_geometry((20, 56, 56, 64), (3, 3, 64, 64), (1, 1), "SAME")
    wgrad = plan_conv(_FULL, geo, 0.6)
    self.assertGreater(wgrad.gk, 1)
    self.assertTrue(wgrad.fits)
    self.assertLess(wgrad.temp_bytes, _FULL.bytes_per_tile)
    rate = lambda plan: 1.0 / (plan.cycles * plan.num_tiles)  # same MACs
    self.assertGreater(rate(wgrad), 0.5 * rate(fwd))

  def test_stem_weight_gradient_fits(self):
    # 224x224x3, 7x7 stride 2 -> 64: the whole 20x112x112 contraction on a
    # tile needed megabytes.
    geo = _weight_grad_geometry((20, 224, 224, 3), (7, 7, 3, 64), (2, 2), ((3, 3), (3, 3)))
    plan = plan_conv(_FULL, geo, 0.6)
    self.assertGreater(plan.gk, 1)
    self.assertTrue(plan.fits)
    self.assertLess(plan.temp_bytes, _FULL.bytes_per_tile)

  def test_forward_plan_keeps_the_contraction_whole(self):
    geo = _forward_geometry((20, 56, 56, 64), (3, 3, 64, 64), (20, 56, 56, 64), (1, 1),
                            ((1, 1), (1, 1)))
    plan = plan_conv(_FULL, geo, 0.6)
    self.assertEqual(plan.gk, 1)
    self.assertNotIn(".k", plan.label)

  def test_reduce_step_on_the_lowered_weight_gradient(self):
    x, g = _random((4, 14, 14, 8)), _random((4, 14, 14, 8), seed=1)
    lowered = ipu_jax.jit(_weight_grad(), target=_SMALL).lower(x, g)
    steps = _conv_steps(lowered)
    self.assertLen(steps, 2)
    self.assertGreater(int(steps[1].exchange_bytes_in.sum()), 0)
    self.assertGreater(float(np.max(steps[1].compute_cycles)), 0)


class ConvStagedReduceTest(chex.TestCase, parameterized.TestCase):
  """16 or more partials a block reduce in poplin's stages, as a matmul's do.

  poplin plans a convolution's reduction as a matmul's (a matmul is its 1x1
  convolution; lib/poplin/ConvReducePlan.cpp 20-26: two stages from a depth
  of 16): a weight gradient of [16, 16, 16, 4] on 16 tiles sums its 16 images
  on 16 tiles (``k16x1``), [8, 16, 16, 4] its 8 images x 2 row halves
  (``k8x2``); both reduce 16 -> 4 -> 1, a superstep a stage, each stage's
  ReduceAdd what poplin's estimateConvReduceCycles prices for it
  (experiments/poplibs_reference.py), and the plan prices what is emitted.
  """

  @parameterized.named_parameters(
      ("k16x1_float", (16, 16, 16, 4), jnp.float32, None, "k16x1"),
      ("k8x2_half", (8, 16, 16, 4), jnp.float16, "float16", "k8x2"),
      ("k16x1_half_float_partials", (16, 16, 16, 4), jnp.float16, None, "k16x1"))
  def test_stages_are_poplins(self, x_shape, dtype, partials, split):
    from experiments import poplibs_reference as ref
    from ipu_jax.lowering import matmul_cost
    x, g = _random(x_shape, dtype), _random(x_shape, dtype, seed=1)
    cfg = testing_utils.executor_config(matmuls={"partials_type": partials})
    lowered = ipu_jax.jit(_weight_grad(), target=_SMALL, config=cfg).lower(x, g)
    steps = _conv_steps(lowered)
    self.assertIn(f".{split} ", steps[0].name)
    self.assertEqual([s.name.rsplit(" ", 3)[-3:] for s in steps[1:]],
                     [["stage", "1/2", "reduce"], ["stage", "2/2", "reduce"]])
    block, gk = 3 * 3 * 4 * 4, 16
    p_size = 2 if partials == "float16" else 4
    want = ref.poplin_conv_reduce_stages(block // gk, gk, p_size == 4, p_size == 4,
                                         _SMALL.bytes_per_tile)
    got = [float(s.compute_cycles.max()) for s in steps[1:]]
    self.assertEqual(got, [float(cycles) for _, _, cycles in want])
    figures = matmul_cost.staged_scatter_figures(_SMALL, gk, (4, 1), np.array([block]), p_size)
    self.assertEqual(got, [float(f["compute"].max()) for f in figures])
    geo = _weight_grad_geometry(x_shape, (3, 3, 4, 4), (1, 1), "SAME",
                                itemsize=np.dtype(dtype).itemsize, acc_itemsize=p_size,
                                dtype=np.dtype(dtype).name)
    plan = plan_conv(_SMALL, geo, 0.6)
    self.assertEqual((plan.gk, plan.scatter_stages), (gk, (4, 1)))
    self.assertEqual(plan.reduce_cycles,
                     sum(s.sync_cycles + s.exchange_cycles + float(s.compute_cycles.max())
                         for s in steps[1:]))
    np.asarray(lowered(x, g))

  @parameterized.product(mode=("batched", "per_tile"), half=(False, True))
  def test_matches_jit(self, mode, half):
    dtype = jnp.float16 if half else jnp.float32
    x, g = _random((16, 16, 16, 4), dtype), _random((16, 16, 16, 4), dtype, seed=1)
    fn = _weight_grad()
    cfg = testing_utils.executor_config(mode, matmuls={"partials_type": "float16" if half
                                                       else None})
    lowered = ipu_jax.jit(fn, target=_SMALL, config=cfg).lower(x, g)
    self.assertTrue(_conv_steps(lowered)[-1].name.endswith(".k16x1 blocks 4x4x3x3 stage 2/2 "
                                                           "reduce"))
    got = np.asarray(lowered(x, g), np.float32)
    want = np.asarray(jax.jit(fn)(x, g), np.float32)
    if half:  # fp16 partials: image j's partial, sections of 4 summed in order, then the 4 sums
      parts = [np.asarray(jax.jit(fn)(x[j:j + 1], g[j:j + 1])) for j in range(16)]
      add = lambda a, b: (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
      sums = [functools.reduce(add, parts[lo:lo + 4]) for lo in range(0, 16, 4)]
      np.testing.assert_array_equal(got, functools.reduce(add, sums).astype(np.float32))
      chex.assert_trees_all_close(got, want, rtol=2e-2, atol=0.5)
    else:
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-3)

  def test_half_partials_one_stage_same_order_in_both_modes(self):
    # On 8 tiles at most 8 partials a block, reduced in one stage; fp16
    # partials are added in order in both executor modes.
    x, g = _random((4, 14, 14, 8), jnp.float16), _random((4, 14, 14, 8), jnp.float16, seed=1)
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8)
    got = {}
    for mode in ("batched", "per_tile"):
      cfg = testing_utils.executor_config(mode, matmuls={"partials_type": "float16"})
      lowered = ipu_jax.jit(_weight_grad(), target=target, config=cfg).lower(x, g)
      self.assertRegex(_conv_steps(lowered)[-1].name, r"\.k\d+x\d+ blocks [\dx]+ reduce$")
      got[mode] = np.asarray(lowered(x, g), np.float32)
    np.testing.assert_array_equal(got["batched"], got["per_tile"])
    chex.assert_trees_all_close(got["batched"], np.asarray(jax.jit(_weight_grad())(x, g),
                                                           np.float32), rtol=2e-2, atol=0.5)


class ConvExchangeBusSharingTest(chex.TestCase, parameterized.TestCase):
  """A bus pair's shared input window, priced as poplin's ExchangeEstimator prices it.

  lib/poplin/ConvModel.cpp addExchangeCycleEstimates prices a partition's
  input elements with ExchangeEstimator::getInputElementCycles and its
  weights with getCycles (lib/poplin/ExchangeEstimator.hpp): where the target
  shares exchange buses (two tiles a bus) and ``outChanSplit.parallel`` is
  even, input elements cost ``ceil(elements * size * 16 / (round(4 B * 16) *
  2))`` cycles (twice the 4 B a cycle), weights ``ceil(elements * size * 16 /
  64)``; linearizeConvIndices (lib/poplin/Convolution.cpp) puts the
  output-channel split innermost so that a bus pair needs the same input.
  """

  def test_bus_pairs_receive_their_shared_window_at_twice_the_rate(self):
    # [1, 4, 4, 16] * [1, 1, 16, 64] float16 on 16 tiles: grid n1.c8.s1x2,
    # blocks 1x8x4x2: 8 feature blocks (an even outChanSplit) innermost, so
    # tiles 2j, 2j + 1 share a 4x2x16 input window (128 elements). x lies
    # one image row a tile on tiles 0..3; w one input channel (64 elements)
    # a tile, so each tile holds 8 of its 16x8 kernel block. Poplin's rates
    # on what a tile of 4..15 receives: inputs ceil(128 x 2 x 16 / (64 x 2))
    # = 32 cycles, weights ceil(120 x 2 x 16 / 64) = 60, + 100 exchange
    # latency = 192. Tiles 0..3 hold 32 of their window, their partner 32
    # more: 64 elements shared (128 B at 8 B a cycle) and 32 alone (64 B at
    # 4 B), the same 32 cycles. Both at 4 B a cycle, as before cost model
    # 19: (256 + 240) / 4 + 100 = 224.
    x, w = _random((1, 4, 4, 16), jnp.float16), _random((1, 1, 16, 64), jnp.float16, seed=1)
    lowered = ipu_jax.jit(_conv(padding="VALID"), target=_SMALL).lower(x, w)
    step, = _conv_steps(lowered)
    self.assertIn("grid n1.c8.s1x2 ", step.name)
    np.testing.assert_array_equal(step.exchange_bytes_in, [432] * 4 + [496] * 12)
    self.assertEqual(step.exchange_cycles, 192.0)
    # Only placement and cycles move: the values are jax.jit's.
    _check(_conv(padding="VALID"), x, w, tol=2e-2, target=_SMALL)

  @parameterized.named_parameters(
      # The same convolution planned: 16 feature blocks of 4 (an even split;
      # since cost model 21 the AMP's [4, 16] x [16, 16] pass, one row a worker,
      # is cheaper than [8, 16] x [16, 8], two rows on some: PE's 1- and 2-row
      # entries). Window 4x4x16 (512 B) at the shared rate, kernel block 16x4
      # (128 B) at 4 B a cycle: 512 / 8 + 128 / 4 + 100.
      ("even_feature_split", (1, 4, 4, 16), (1, 1, 16, 64), 1, "grid n1.c16.s1x1 ", 196.0),
      # 4 groups of 2 features, 2 blocks of 2 whole groups: poplin's
      # conv-group split, its outChanSplit 1 (odd): window 4x8x4 (256 B) and
      # kernel block 4x2x9 (144 B) both at 4 B a cycle: 400 / 4 + 100.
      ("whole_groups", (2, 8, 8, 8), (3, 3, 2, 8), 4, "grid n2.c2.s1x4 ", 200.0))
  def test_plan_prices_the_window_at_the_shared_rate_when_the_split_is_even(
      self, x_shape, w_shape, fgc, label, exchange):
    pad = ((0, 0), (0, 0)) if w_shape[0] == 1 else ((1, 1), (1, 1))
    out_shape = x_shape[:3] + w_shape[3:]
    geo = conv_geometry(x_shape, w_shape, out_shape, ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
                        (1, 1), pad, (1, 1), (1, 1), fgc, 1, 2, 2, "float16")
    plan = plan_conv(_SMALL, geo, 0.6)
    self.assertIn(label, plan.label + " ")
    self.assertEqual(plan.exchange_cycles, exchange)


if __name__ == "__main__":
  absltest.main()
