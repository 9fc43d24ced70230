"""The int8 and int4 formats' CPU operators (quantized_linear.cpp): the products they stand for,
a row's result its own whatever travels with it, and the formats' layers computing with them."""

import pytest
import torch

from inference.worker.engine import cpu_ops
from inference.worker.engine.llama import Int8, LlamaWeights, OwnInt4, OwnInt8, linear


@pytest.fixture(scope="module", autouse=True)
def operator(tmp_path_factory):
    cpu_ops.load(tmp_path_factory.mktemp("compiled"))


def layer(fmt, rows=3072, columns=576, seed=0):
    """A layer in `fmt` over random weights."""
    return linear(torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) / 10, fmt)


def inputs(rows, columns=576, seed=1):
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))


def as_quantized(x):
    """x as the operators take it, in float64: each group of 32 along a row rounded to the
    nearest of 255 steps of its largest magnitude / 127 (the GGUF's Q8_1, as llama.cpp does)."""
    groups = x.reshape(len(x), -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return ((groups * inverse).round().double() * step.double()).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32])
def test_it_gives_the_product_of_the_weights_it_keeps_and_x_in_groups_of_int8(fmt, rows):
    made, x = layer(fmt), inputs(rows)
    y = made(x).double()
    torch.testing.assert_close(y, as_quantized(x) @ made.dense().T, rtol=1e-5, atol=1e-5)
    exact = x.double() @ made.dense().T
    assert (y - exact).norm() / exact.norm() < 0.01  # what quantizing x costs


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_rows_result_is_its_own_whatever_travels_with_it(fmt):
    # Rows are taken four at a time against a block's unpacked weights, the rest one by one:
    # every output's sums must be the same operations either way, on any thread.
    made = layer(fmt)
    x = inputs(300)
    whole = made(x)
    for size in (1, 2, 3, 4, 5, 7, 8, 17, 40):
        assert torch.equal(made(x[:size]), whole[:size]), size
    assert torch.equal(made(x[7:8]), whole[7:8])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(made(x), whole)
    finally:
        torch.set_num_threads(threads)


def test_an_all_zero_group_of_x_adds_nothing():
    made, x = layer("int4"), inputs(2)
    x[0, :32] = 0
    torch.testing.assert_close(made(x).double(), as_quantized(x) @ made.dense().T, rtol=1e-5, atol=1e-5)


def test_int4_keeps_the_groups_of_a_q4_1_matrix_exactly():
    # A matrix as the GGUF's Q4_1 blocks give it: codes 0 to 15 (both ends in every group)
    # times a float16 scale, plus a float16 minimum.
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 18, 32), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(64, 18, 1, generator=generator) / 50 + 1e-3).half().float()
    minimum = (-torch.rand(64, 18, 1, generator=generator) / 5).half().float()
    weight = (codes * scale + minimum).reshape(64, 576)
    made = OwnInt4(weight)
    assert made.error == 0
    assert torch.equal(made.dense(), weight.double())


def test_shapes_and_dtypes_it_cannot_take_are_refused_clearly():
    made = layer("int8", rows=8, columns=64)
    with pytest.raises(RuntimeError, match="float32"):
        made.mm(inputs(2, 64).bfloat16(), *made.weights())
    with pytest.raises(RuntimeError, match="inputs"):
        made.mm(inputs(2, 32), *made.weights())
    with pytest.raises(RuntimeError, match=r"\[out / 8, in / 32, 256\]"):
        made.mm(inputs(2, 64), made.weight.reshape(8, 64), made.scale)


def test_the_formats_compute_with_them_and_keep_torchs_kernels_for_shapes_they_cannot_take(model):
    for fmt, own in (("int8", OwnInt8), ("int4", OwnInt4)):
        weights = LlamaWeights(model.model, fmt)
        assert all(isinstance(layer, own) for layer in weights.layers[0].linears()), fmt
        assert type(weights.lm_head) is OwnInt8  # 6-bit in the GGUF: 4 bits would lose too much
    assert type(linear(torch.randn(12, 576), "int8")) is Int8  # 12 outputs: not a multiple of the operators' block
    assert type(linear(torch.randn(12, 576), "int4")) is Int8  # neither int4 kernel takes 12 outputs
