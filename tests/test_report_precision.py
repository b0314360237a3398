"""Number-format telemetry in the report: loss scale and FP8 per-tensor scales
recorded per step (a user loop, Keras-like fit), in report.json, the summary,
number_formats.png and report.html."""

import json
import os
import shutil
import subprocess

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.fp8_scaling import (FP8GradAmax, FP8Linear, FP8Stats, apply_gradient_telemetry,
                                 scale_of_amax)
from ipu_jax.keras import LossScaleOptimizer
from ipu_jax.report import NumberFormatTelemetry
from ipu_jax.report import cli as report_cli
from ipu_jax.report import html as report_html
from ipu_jax.report.compare import comparison_to_dict
from ipu_jax.strategy import IPUStrategy

T16 = ipu_jax.IPUTarget.preset("ipu21", tiles_per_ipu=16)
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_page_harness.js")


def _run_page(test, node, page) -> dict:
  """Runs ``page``'s script under node, checks the number-format section and
  its link are shown; returns what the harness read and its plots by div id."""
  run = subprocess.run([node, _HARNESS, page], capture_output=True, text=True, timeout=60)
  test.assertEqual(run.returncode, 0, run.stderr)
  result = json.loads(run.stdout)
  test.assertTrue(result["ready"])
  test.assertEqual(result["hidden"], {"section": False, "link": False})
  return result, {p["div"]: p for p in result["plots"]}


class Net(nnx.Module):
  """Two FP8 dense layers: every tensor kind of the paper's figures."""

  def __init__(self, rngs):
    self.a = FP8Linear(8, 16, rngs=rngs)
    self.b = FP8Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


def _layer_fields(amax_w, amax_x, amax_g=None):
  fields = {"weight_amax": np.asarray([0.0, amax_w]), "weight_scale": scale_of_amax(amax_w),
            "input_amax": np.asarray([0.0, amax_x]), "input_scale": scale_of_amax(amax_x)}
  if amax_g is not None:
    fields["grad_amax"] = np.asarray([0.0, amax_g])
    fields["grad_scale"] = scale_of_amax(amax_g, "F152")
  return fields


class TelemetryTest(chex.TestCase):

  def test_records_by_kind_and_round_trips_through_json(self):
    t = NumberFormatTelemetry()
    self.assertTrue(t.empty)
    self.assertIsNone(t.to_json())
    self.assertIsNone(t.last_step)
    t.record_loss_scale(1, 2.0 ** 12, 0, 0)
    t.record_loss_scale(2, 2.0 ** 11, 1, 1)
    # A layer whose gradient telemetry was never differentiated has none.
    t.record_fp8(1, {"dense": _layer_fields(0.5, 3.0, 0.01), "head": _layer_fields(2.0, 1.0)})
    t.record_fp8(2, {"dense": _layer_fields(0.25, 3.0, 0.02), "head": _layer_fields(2.0, 1.0)})
    self.assertEqual(t.last_step, 2)
    self.assertEqual(sorted(t.fp8), ["dense/grad", "dense/input", "dense/kernel", "head/input",
                                     "head/kernel"])
    grad = t.fp8["dense/grad"]
    self.assertEqual((grad.kind, grad.format, grad.steps), ("gradients", "F152", [1, 2]))
    # F152: max 57344 = 1.75 * 2^15; 0.01 -> floor(log2(5.7e6)) = 22.
    self.assertEqual(grad.log2_scale, [22, 21])
    self.assertEqual(t.fp8["dense/kernel"].log2_scale, [8, 9])   # 240 / 0.5 = 480 -> 8
    by_kind = t.scales_by_kind()
    self.assertEqual(sorted(by_kind), ["activations", "gradients", "weights"])
    self.assertLen(by_kind["weights"], 4)
    again = NumberFormatTelemetry.from_json(json.loads(json.dumps(t.to_json())))
    self.assertEqual(again.to_json(), t.to_json())

  def test_bad_records_say_what_is_wrong(self):
    t = NumberFormatTelemetry()
    t.record_loss_scale(3, 8.0, 0, 0)
    with self.assertRaisesRegex(ValueError, "steps must increase; step 3 comes after step 3"):
      t.record_loss_scale(3, 8.0, 0, 0)
    with self.assertRaisesRegex(ValueError, "step must be an int >= 0"):
      t.record_loss_scale(-1, 8.0, 0, 0)
    with self.assertRaisesRegex(ValueError, "scale must be positive and finite"):
      t.record_loss_scale(4, float("inf"), 0, 0)
    with self.assertRaisesRegex(ValueError, "pass model or fp8, not both"):
      t.record(5, model=object(), fp8={})


class ReportTest(parameterized.TestCase):
  """A user training loop of an FP8 model with dynamic loss scaling."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = Net(nnx.Rngs(0))
    graphdef, params, probes, rest = nnx.split(cls.model, nnx.Param, FP8GradAmax, ...)
    opt = LossScaleOptimizer(optax.sgd(0.05), 2.0 ** 4, growth_steps=2)

    def loss_of(p, probes, rest, x, y, scale):
      m = nnx.merge(graphdef, p, probes, rest, copy=True)
      return jnp.mean((m(x) - y) ** 2) * scale, nnx.state(m, FP8Stats)

    def step(params, probes, rest, opt_state, x, y):
      (_, stats), (g, g_probes) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
          params, probes, rest, x, y, opt_state.loss_scale)
      updates, opt_state = opt.update(g, opt_state, params)
      return (optax.apply_updates(params, updates), apply_gradient_telemetry(probes, g_probes),
              nnx.merge_state(rest, stats), opt_state)

    rng = np.random.default_rng(0)
    cls.x = jnp.asarray(rng.normal(size=(8, 8)) * 3, jnp.float32)
    cls.y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    # The gradient reaching the last layer's output at step 1, in float32.
    m0 = nnx.merge(graphdef, params, probes, rest, copy=True)
    hidden = jax.nn.relu(cls.x @ m0.a.kernel[...] + m0.a.bias[...])
    out = hidden @ m0.b.kernel[...] + m0.b.bias[...]
    cls.out_grad_amax = float(jnp.max(jnp.abs(2 * (out - cls.y) / out.size))) * 2.0 ** 4
    opt_state = opt.init(params)
    lowered = ipu_jax.jit(step, target=T16).lower(params, probes, rest, opt_state, cls.x, cls.y)
    cls.report = lowered.report
    cls.scales = []
    for i in range(3):
      params, probes, rest, opt_state = lowered(params, probes, rest, opt_state, cls.x, cls.y)
      nnx.update(cls.model, params, probes, rest)
      cls.report.add_number_format_telemetry(i + 1, model=cls.model, opt_state=opt_state)
      cls.scales.append(float(opt_state.loss_scale))

  def test_every_tensor_kind_is_recorded_per_step(self):
    t = self.report.number_formats
    self.assertEqual(sorted(t.fp8), ["a/grad", "a/input", "a/kernel", "b/grad", "b/input",
                                     "b/kernel"])
    for tensor in t.fp8.values():
      self.assertEqual(tensor.steps, [1, 2, 3])
      fmt = "F152" if tensor.kind == "gradients" else "F143"
      self.assertEqual(tensor.format, fmt)
      np.testing.assert_array_equal(tensor.log2_scale, scale_of_amax(tensor.amax, fmt))
    # The first layer's input is x at every step.
    np.testing.assert_allclose(t.fp8["a/input"].amax, float(jnp.max(jnp.abs(self.x))))
    # The output gradient, scaled by the loss scale, is what F152 casts (FP8 forward
    # error makes it close, not equal, to the float32 one).
    np.testing.assert_allclose(t.fp8["b/grad"].amax[0], self.out_grad_amax, rtol=0.15)
    # Dynamic loss scaling, growth every 2 finite steps: 16, 32, 32.
    self.assertEqual(t.loss_scaling.scale, self.scales)
    self.assertEqual(self.scales, [16.0, 32.0, 32.0])
    self.assertEqual(t.loss_scaling.skipped_steps, [0, 0, 0])

  def test_summary_json_and_saved_report(self):
    summary = self.report.summary()
    self.assertIn("Number formats:", summary)
    self.assertIn("Loss scale:            2^4 at step 1 -> 2^5 at step 3", summary)
    self.assertRegex(summary, r"gradients\s+F152\s+2\s")
    directory = self.create_tempdir().full_path
    written = self.report.save(directory)
    self.assertIn(os.path.join(directory, "number_formats.png"), written)
    with open(os.path.join(directory, "number_formats.png"), "rb") as f:
      self.assertEqual(f.read(4), b"\x89PNG")
    saved = ipu_jax.load_report(directory)
    self.assertEqual(saved.number_formats.to_json(), self.report.number_formats.to_json())
    self.assertEqual(saved.summary(), summary)
    with open(os.path.join(directory, "report.json")) as f:
      entry = json.load(f)["number_formats"]
    self.assertEqual(entry["loss_scaling"]["scale"], self.scales)
    self.assertLen(entry["fp8_tensors"], 6)

  def test_report_html_draws_the_section(self):
    node = shutil.which("node")
    if node is None:
      self.skipTest("node (nodejs) is not installed: the page's script cannot be run")
    directory = self.create_tempdir().full_path
    self.report.save(directory, plots=False)
    page = os.path.join(directory, "report.html")
    if not os.path.exists(page):
      self.skipTest("plotly is not installed, so report.html is not written")
    result, plots = _run_page(self, node, page)
    kinds = {t["name"]: t["x"] for t in plots["fp8-scales-chart"]["traces"]}
    self.assertEqual(kinds["gradients"], self.report.number_formats.scales_by_kind()["gradients"])
    self.assertEqual(plots["loss-scale-chart"]["traces"][0]["y"], self.scales)
    self.assertIn("a/grad", result["table"])

  def test_a_program_without_telemetry_has_no_section(self):
    report = ipu_jax.jit(lambda x: x * 2, target=T16).lower(jnp.ones(4)).report
    self.assertIsNone(report.number_formats)
    self.assertIsNone(report.to_dict()["number_formats"])
    self.assertNotIn("Number formats", report.summary())
    directory = self.create_tempdir().full_path
    self.assertNotIn("number_formats.png", " ".join(report.save(directory, html=False)))
    with self.assertRaisesRegex(TypeError, "must be a NumberFormatTelemetry"):
      report.number_formats = {"loss_scaling": None}


class FitTest(chex.TestCase):

  def test_fit_puts_its_loss_scale_and_fp8_scales_in_the_train_report(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=32).astype(np.int32)
    cfg = ipu_jax.IPUConfig()
    cfg.device.version = "ipu21"
    cfg.device.tiles_per_ipu = 16
    with IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(Net(nnx.Rngs(0)))
      model.compile(optimizer=LossScaleOptimizer(optax.sgd(0.1), 2.0 ** 6, growth_steps=1),
                    loss="sparse_categorical_crossentropy", steps_per_execution=2)
    logs = []
    cb = ipu_jax.keras.LambdaCallback(on_train_batch_end=lambda b, l: logs.append(dict(l)))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    t = model.report.number_formats
    self.assertIs(t, model.number_formats)
    # One record per execution (2 updates each), as the logs saw it: growth every step.
    self.assertEqual(t.loss_scaling.steps, [2, 4])
    self.assertEqual(t.loss_scaling.scale, [l["loss_scale"] for l in logs])
    self.assertEqual(t.loss_scaling.scale, [2.0 ** 8, 2.0 ** 10])
    # The FP8 layers' forward telemetry comes from the model state; fit does not
    # differentiate the gradient histories, so there are no gradient scales.
    self.assertEqual(sorted(t.fp8), ["a/input", "a/kernel", "b/input", "b/kernel"])
    np.testing.assert_allclose(t.fp8["a/input"].amax,
                               [np.abs(x[8:16]).max(), np.abs(x[24:32]).max()])
    self.assertIn("Loss scale:            2^8 at step 2 -> 2^10 at step 4", model.report.summary())


class CompareTest(chex.TestCase):
  """An fp16 run with dynamic loss scaling against an FP8 run: compare_reports,
  its JSON and the comparison page show their number formats side by side."""

  def setUp(self):
    super().setUp()
    x = jnp.ones((8, 8), jnp.float32)
    self.fp16 = ipu_jax.jit(lambda x: (x.astype(jnp.float16) * 2).astype(jnp.float32),
                            target=T16).lower(x).report
    self.fp8 = ipu_jax.jit(lambda x: x * 3.0, target=T16).lower(x).report
    loss = NumberFormatTelemetry()
    for step, scale, skipped in ((1, 2.0 ** 15, 0), (2, 2.0 ** 14, 1), (3, 2.0 ** 14, 1)):
      loss.record_loss_scale(step, scale, skipped, skipped)
    fp8 = NumberFormatTelemetry()
    for step in (1, 2):
      fp8.record_fp8(step, {"a": _layer_fields(0.5 * step, 3.0, 1e-3),
                            "b": _layer_fields(2.0, 100.0)})
    self.fp16.number_formats, self.fp8.number_formats = loss, fp8

  def test_text_lists_both_runs_number_formats(self):
    text = ipu_jax.compare_reports(self.fp16, self.fp8)
    section = text[text.index("Number formats"):]
    self.assertRegex(section, r"Loss scale, first\s+2\^15\s+-\n")
    self.assertRegex(section, r"Loss scale, last\s+2\^14\s+-\n")
    self.assertRegex(section, r"Skipped steps\s+1\s+-\n")
    weights = [scale_of_amax(v) for v in (0.5, 2.0, 1.0, 2.0)]
    self.assertRegex(section, r"FP8 weights \(F143\) tensors\s+-\s+2\n")
    self.assertRegex(section, rf"FP8 weights log2 scale, max\s+-\s+{max(weights)}\n")
    self.assertRegex(section, r"FP8 gradients \(F152\) tensors\s+-\s+1\n")
    # Both sides recorded a loss scale: the delta is in binades, the change a ratio.
    both = NumberFormatTelemetry()
    both.record_loss_scale(1, 2.0 ** 12, 0, 0)
    self.fp8.number_formats.loss_scaling = both.loss_scaling
    text = ipu_jax.compare_reports(self.fp16, self.fp8)
    self.assertRegex(text, r"Loss scale, first\s+2\^15\s+2\^12\s+-3 binades\s+x0.125\n")
    self.assertRegex(text, r"Skipped steps\s+1\s+0\s+-1\s+-100.0%\n")

  def test_no_section_without_telemetry(self):
    plain = ipu_jax.jit(lambda x: x + 1.0, target=T16).lower(jnp.ones(4)).report
    self.assertNotIn("Number formats", ipu_jax.compare_reports(plain, plain))
    self.assertIsNone(comparison_to_dict(plain, plain)["number_formats"])

  def test_json_of_the_comparison_from_saved_reports(self):
    directories = []
    for report in (self.fp16, self.fp8):
      directories.append(self.create_tempdir().full_path)
      report.save(directories[-1], plots=False, html=False)
    out = os.path.join(self.create_tempdir().full_path, "diff.json")
    self.assertEqual(report_cli.main([*directories, "--json", out]), 0)
    with open(out) as f:
      document = json.load(f)
    self.assertEqual(document, json.loads(json.dumps(comparison_to_dict(self.fp16, self.fp8))))
    formats = document["number_formats"]
    self.assertEqual(formats["loss_scaling"]["a"]["last_scale"], 2.0 ** 14)
    self.assertEqual(formats["loss_scaling"]["a"]["overflows"], 1)
    self.assertIsNone(formats["loss_scaling"]["b"])
    self.assertEqual(set(formats["fp8"]), {"weights", "activations", "gradients"})
    self.assertEqual(formats["fp8"]["activations"]["b"]["max_amax"], 100.0)
    self.assertIsNone(formats["fp8"]["activations"]["a"])
    totals = document["totals"]["cycles"]
    self.assertEqual(totals["delta"], totals["b"] - totals["a"])

  def test_comparison_page_draws_the_section(self):
    node = shutil.which("node")
    if node is None:
      self.skipTest("node (nodejs) is not installed: the page's script cannot be run")
    try:
      page_text = report_html.comparison_html(self.fp16, self.fp8)
    except ImportError:
      self.skipTest("plotly is not installed, so the comparison page is not written")
    page = os.path.join(self.create_tempdir().full_path, "diff.html")
    report_html.write_page(page_text, page)
    result, plots = _run_page(self, node, page)
    self.assertEqual([t["y"] for t in plots["loss-scale-chart"]["traces"]],
                     [self.fp16.number_formats.loss_scaling.scale])
    fp8_scales = [s for t in self.fp8.number_formats.fp8.values() for s in t.log2_scale]
    self.assertEqual([t["x"] for t in plots["fp8-scales-chart"]["traces"]], [fp8_scales])
    for label in ("Loss scale, first", "FP8 gradients (F152) tensors", "2^15"):
      self.assertIn(label, result["comparisonTable"])


if __name__ == "__main__":
  absltest.main()
