"""Checkpoints: sharded with Orbax, the configuration as JSON, restored onto other meshes."""

import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import mesh

import ringeqx as rx


pytest.importorskip("orbax.checkpoint")


@pytest.fixture
def _own_checks():
    """Our own checks, as a user without jaxtyping's hook meets them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


def _bitwise_equal(a, b) -> None:
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        # As bytes: bitwise, NaN payloads and the signs of zeros included.
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _trainer(m, optimizer):
    @eqx.filter_jit
    def step(model, state, tokens, labels):
        def loss(model):
            losses = jax.vmap(lambda t, y: model.loss(t, y, mesh=m))(tokens, labels)
            return jnp.mean(losses)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        # optax mixes Python floats with int32 step counts; our code is strict, optax not.
        with jax.numpy_dtype_promotion("standard"):
            params = eqx.filter(model, eqx.is_array)
            updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, value

    return step


def test_a_checkpoint_from_8_devices_restores_onto_4_and_training_continues(tmp_path):
    m8, m4 = mesh(8), mesh(4)
    model = rx.nn.RingTransformerLM(
        13, 12, 3, 2, num_kv_heads=1, hidden=20,
        attention=rx.nn.AttentionOptions(kernel=rx.XlaKernel(8, 8)), key=jax.random.key(1),
    )
    data = jax.random.randint(jax.random.key(2), (2, 17), 0, 13)
    tokens, labels = data[:, :-1], data[:, 1:]
    optimizer = optax.adamw(3e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    replicated = jax.sharding.NamedSharding(m8, jax.sharding.PartitionSpec())
    model, state = eqx.filter_shard((model, state), replicated)

    step8 = _trainer(m8, optimizer)
    for _ in range(2):
        model, state, _ = step8(model, state, tokens, labels)
    rx.nn.save_checkpoint(tmp_path / "ckpt", model, state, step=2)
    uninterrupted = []
    saved_model, saved_state = model, state
    for _ in range(2):
        model, state, loss = step8(model, state, tokens, labels)
        uninterrupted.append(float(loss))

    restored = rx.nn.load_checkpoint(tmp_path / "ckpt", optimizer=optax.adamw(3e-2), mesh=m4)
    assert restored.step == 2
    _bitwise_equal(restored.model, saved_model)
    _bitwise_equal(restored.opt_state, saved_state)
    static = eqx.partition(restored.model, eqx.is_array)[1]  # masks, kernels, sizes
    assert eqx.tree_equal(static, eqx.partition(saved_model, eqx.is_array)[1]) is True
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(saved_state)
    for leaf in jax.tree.leaves(eqx.filter((restored.model, restored.opt_state), eqx.is_array)):
        assert leaf.sharding.device_set == set(m4.devices.flat)

    step4 = _trainer(m4, optimizer)
    model, state = restored.model, restored.opt_state
    resumed = []
    for _ in range(2):
        model, state, loss = step4(model, state, tokens, labels)
        resumed.append(float(loss))
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "precision",
    [rx.nn.Precision("bfloat16", "bfloat16", "bfloat16"), rx.nn.Precision.mixed()],
    ids=["bfloat16", "mixed"],
)
def test_round_trip_of_low_precision_and_every_stored_option(tmp_path, precision):
    # Every kind of option the configuration stores: a composed mask with an array (the
    # block-sparse pattern), a score modifier, a kernel object, sinks, a ring config, the
    # precision; scanned SwiGLU layers.
    pattern = jnp.asarray(np.tril(np.ones((4, 4), bool)))
    options = rx.nn.AttentionOptions(
        mask=(rx.SlidingWindow(5) & rx.Document()) | rx.BlockSparse(pattern, 4),
        score_mod=rx.Softcap(30.0),
        sinks=True,
        kernel=rx.XlaKernel(8, 8),
        config=rx.RingConfig(bidirectional=True),
    )
    model = rx.nn.RingTransformerLM(
        17, 12, 3, 3, num_kv_heads=1, hidden=20, attention=options, precision=precision,
        scan_layers=True, mlp="swiglu", norm_bias=False, checkpoint="block",
        key=jax.random.key(3),
    )
    rx.nn.save_checkpoint(tmp_path / "ckpt", model)
    meta = json.loads((tmp_path / "ckpt" / "ringeqx.json").read_text())
    assert meta["model"]["class"] == "RingTransformerLM" and meta["step"] is None

    restored = rx.nn.load_checkpoint(tmp_path / "ckpt", mesh=mesh(2))
    assert restored.opt_state is None and restored.step is None
    _bitwise_equal(restored.model, model)
    static = eqx.partition(restored.model, eqx.is_array)[1]
    assert eqx.tree_equal(static, eqx.partition(model, eqx.is_array)[1]) is True
    assert restored.model.precision == precision
    dtypes = {x.dtype for x in jax.tree.leaves(eqx.filter(restored.model, eqx.is_inexact_array))}
    assert jnp.dtype(precision.param_dtype) in dtypes
    x = jax.random.randint(jax.random.key(4), (16,), 0, 17)
    ids = jnp.asarray([0] * 7 + [1] * 9, jnp.int32)
    m = mesh(2)
    out = restored.model(x, segment_ids=ids, mesh=m)
    assert np.array_equal(out, model(x, segment_ids=ids, mesh=m))


def test_a_model_without_a_configuration_restores_with_like(tmp_path):
    attention = rx.nn.RingAttention(12, 3, key=jax.random.key(5))
    rx.nn.save_checkpoint(tmp_path / "ckpt", attention, step=7)
    with pytest.raises(ValueError, match=r"stores no model configuration .*pass `like=`"):
        rx.nn.load_checkpoint(tmp_path / "ckpt")
    like = eqx.filter_eval_shape(lambda: rx.nn.RingAttention(12, 3, key=jax.random.key(0)))
    restored = rx.nn.load_checkpoint(tmp_path / "ckpt", like=like)
    assert restored.step == 7
    _bitwise_equal(restored.model, attention)
    # Without `mesh`, a concrete template's shardings are the restored arrays'.
    two = jax.sharding.NamedSharding(mesh(2), jax.sharding.PartitionSpec())
    placed = rx.nn.load_checkpoint(tmp_path / "ckpt", like=eqx.filter_shard(attention, two))
    for leaf in jax.tree.leaves(eqx.filter(placed.model, eqx.is_array)):
        assert leaf.sharding.is_equivalent_to(two, leaf.ndim)
    wrong = eqx.filter_eval_shape(
        lambda: rx.nn.RingAttention(12, 3, head_dim=6, key=jax.random.key(0))
    )
    with pytest.raises(ValueError, match="The model template does not match the checkpoint"):
        rx.nn.load_checkpoint(tmp_path / "ckpt", like=wrong)
    with pytest.raises(ValueError, match="holds no optimiser state"):
        rx.nn.load_checkpoint(tmp_path / "ckpt", like=like, optimizer=optax.sgd(1.0))


@pytest.mark.usefixtures("_own_checks")
def test_missing_damaged_and_existing_checkpoints_are_refused_naming_the_path(tmp_path):
    model = rx.nn.RingTransformerLM(11, 8, 2, 1, hidden=8, key=jax.random.key(6))
    path = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match=f"`directory` '{path}' does not exist"):
        rx.nn.load_checkpoint(path)
    rx.nn.save_checkpoint(path, model)
    with pytest.raises(FileExistsError, match=f"`directory` '{path}' exists: pass overwrite"):
        rx.nn.save_checkpoint(path, model)
    rx.nn.save_checkpoint(path, model, step=1, overwrite=True)
    assert rx.nn.load_checkpoint(path).step == 1
    with pytest.raises(ValueError, match=r"`step` must be an int or None; got 1.5"):
        rx.nn.save_checkpoint(tmp_path / "other", model, step=1.5)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"'.*empty' is not a complete ringeqx checkpoint"):
        rx.nn.load_checkpoint(tmp_path / "empty")

    meta = path / "ringeqx.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"`directory` '{path}' is damaged: .* cannot be read"):
        rx.nn.load_checkpoint(path)
    # A configuration naming a class that is not a known option is refused, not imported.
    edited = json.loads(text)
    edited["model"]["arguments"]["attention"]["mask"]["module"] = "os.system"
    meta.write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="is damaged: its model configuration cannot be rebuilt"):
        rx.nn.load_checkpoint(path)
    meta.write_text(text)

    # The arrays' files gone (a copy interrupted, a disk lost): an error, not a model.
    arrays = path / "arrays"
    for root, _, files in os.walk(arrays):
        for name in files:
            if not name.startswith("_") and name != "commit_success.txt":
                os.remove(os.path.join(root, name))
    with pytest.raises(ValueError, match=f"`directory` '{path}' is damaged: its arrays"):
        rx.nn.load_checkpoint(path)


def test_orbax_is_optional_and_named_when_missing(monkeypatch, tmp_path):
    # The core imports no Orbax when imported (a fresh interpreter: this one has it).
    code = "import sys, ringeqx; print(any(m.startswith('orbax') for m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    model = rx.nn.RingTransformerLM(11, 8, 2, 1, hidden=8, key=jax.random.key(7))
    with pytest.raises(ImportError, match=r"pip install 'ringeqx\[checkpoint\]'"):
        rx.nn.save_checkpoint(tmp_path / "ckpt", model)


def test_pickle_files_still_load_but_warn(tmp_path):
    model = rx.nn.RingTransformerLM(11, 8, 2, 1, hidden=8, key=jax.random.key(8))
    with pytest.warns(DeprecationWarning, match="`ringeqx.nn.save_model` is deprecated"):
        rx.nn.save_model(tmp_path / "m.eqx", model)
    with pytest.warns(DeprecationWarning, match="`ringeqx.nn.load_model` is deprecated"):
        loaded = rx.nn.load_model(tmp_path / "m.eqx")
    assert bool(eqx.tree_equal(loaded, model))
    # A file saved before the core moved into folders names `ringeqx._masks.And`, whose
    # module is now a package: its classes are found where they moved.
    old = os.path.join(os.path.dirname(__file__), "data", "attention_before_folders.eqx")
    with pytest.warns(DeprecationWarning):
        attention = rx.nn.load_model(old)
    assert attention.mask == rx.Causal() & rx.SlidingWindow(4)
    # A model saved before `nn/_transformer.py` was split into `_block.py` and `_lm.py`
    # names `ringeqx.nn._transformer.RingTransformerLM` and `.TransformerBlock`.
    old = os.path.join(os.path.dirname(__file__), "data", "lm_before_block_split.eqx")
    with pytest.warns(DeprecationWarning):
        lm = rx.nn.load_model(old)
    assert isinstance(lm, rx.nn.RingTransformerLM)
    assert isinstance(lm.blocks[0], rx.nn.TransformerBlock)
    assert lm.blocks[0].attention.mask == rx.Causal()
    # Models saved before the Pallas kernels' modules were split by job name
    # `ringeqx._kernels._pallas_tpu.PallasTpuKernel` and `._pallas_gpu.PallasGpuKernel`.
    for name, kernel in (
        ("tpu", rx.PallasTpuKernel(interpret=True, block_q=64)),
        ("gpu", rx.PallasGpuKernel(interpret=True)),
    ):
        old = os.path.join(
            os.path.dirname(__file__), "data", f"attention_{name}_kernel_before_kernel_split.eqx"
        )
        with pytest.warns(DeprecationWarning):
            attention = rx.nn.load_model(old)
        assert attention.kernel == kernel


def test_two_processes_save_one_checkpoint_that_one_process_restores(tmp_path):
    # 2 processes x 4 fake CPU devices (jax.distributed, gloo), arrays sharded over all
    # 8: each process writes only its own shards; this process (8 devices) restores the
    # checkpoint onto 4, bitwise.
    from test_multiprocess import run_workers

    worker = os.path.join(os.path.dirname(__file__), "_checkpoint_worker.py")
    directory = tmp_path / "ckpt"

    def command(i, port, out):
        return [sys.executable, worker, str(i), "2", str(port), str(out), str(directory)]

    out = run_workers(tmp_path, command=command)[0]
    written = sorted(p.name for p in (directory / "arrays").iterdir() if "process_" in p.name)
    assert written == ["ocdbt.process_0", "ocdbt.process_1"], written
    restored = rx.nn.load_checkpoint(directory, optimizer=optax.adamw(1e-2), mesh=mesh(4))
    assert restored.step == 3
    saved = np.load(out)
    leaves = jax.tree.leaves(eqx.filter((restored.model, restored.opt_state), eqx.is_array))
    assert len(leaves) == len(saved.files) > 10
    for i, leaf in enumerate(leaves):
        want = saved[f"arr_{i}"]
        assert leaf.dtype == want.dtype and np.asarray(leaf).tobytes() == want.tobytes()
