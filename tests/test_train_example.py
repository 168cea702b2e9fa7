"""The training example, examples/train.py: it trains the tiny model on the project's own
text on the 8 fake CPU devices, reports tokens/s and MFU, plots, and refuses bad flags."""

import importlib.util
import re
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import ringeqx as rx


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


@pytest.fixture(scope="module")
def train():
    """examples/train.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("ringeqx_train_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_model_learns_the_text_and_reports(train, tmp_path, capsys):
    plot = tmp_path / "loss.png"
    argv = ["--model", "tiny", "--steps", "10", "--seq-len", "64", "--batch", "4",
            "--log-every", "5", "--eval-batches", "1", "--peak-flops", "1e12",
            "--plot", str(plot)]  # fmt: skip
    result = train.main(argv)
    out = capsys.readouterr().out

    losses = result["losses"]
    assert len(losses) == 10
    # An untrained byte model starts near ln 256 = 5.55 nats, and the bytes' frequencies
    # alone are worth about 2 nats (ten steps reach 3.3-3.5): ask for 1.5.
    assert losses[0] > 5.0, losses
    assert np.mean(losses[-3:]) < losses[0] - 1.5, losses
    # On files it never saw, too.
    assert result["held_out_loss"] < losses[0] - 1.0, (result, losses)

    assert "tokens/s" in out and "step 10/10 [####################]" in out
    assert re.search(r"throughput: [\d,]+ tokens/s, MFU \d+\.\d% of 8e\+12 FLOP/s", out), out
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert re.search(r"held-out \d\.\d{3} \(\d\.\d{3} bits per byte", out), out
    assert plot.read_bytes().startswith(b"\x89PNG"), "no PNG written"


def test_mfu_counts_the_model(train):
    config = train.MODELS["tiny"]
    model = eqx.filter_eval_shape(
        rx.nn.RingTransformerLM.from_config, config, scan_layers=True, key=jax.random.key(0)
    )
    arrays = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    embedding = model.embedding.weight.size
    assert train.non_embedding_params(config) == sum(a.size for a in arrays) - embedding
    # 6 N T for the weights, plus causal attention: half of 2 products of 2 T^2 H d
    # flops per layer and example, three times (forward and backward).
    n, b, t = train.non_embedding_params(config), 3, 40
    attention = 3 * (2 * 2 * t * t * config.num_heads * config.head_dim) / 2
    want = 6 * n * b * t + b * config.num_layers * attention
    assert train.step_flops(config, b, t) == want
    assert "MFU n/a" in train.bar(3, 10, 4.2, None, None)
    assert train.PEAK_FLOPS["TPU v5 lite"] == 197e12  # v5e: the figure


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model", "huge"], "--model"),
        (["--precision", "fp8"], "--precision"),
        (["--steps", "0"], "--steps"),
        (["--batch", "-2"], "--batch"),
        (["--seq-len", "12"], "--seq-len"),  # not a multiple of the 8 devices
        (["--lr", "-1e-3"], "--lr"),
        (["--peak-flops", "nan"], "--peak-flops"),
        (["--log-every", "two"], "--log-every"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(train, capsys, argv, flag):
    with pytest.raises(SystemExit) as exit:
        train.main(argv)
    assert exit.value.code == 2
    assert flag in capsys.readouterr().err
