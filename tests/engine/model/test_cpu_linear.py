"""Prepacked linear layers on the CPU: the same module tree, parameters and ties, outputs of
nn.Linear within float32 rounding at any row count, and a weight changed in place is repacked."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.model.cpu_linear import PrepackedLinear, available, prepack_linears
from engine.model.load import load_model
from engine.types import GenerateRequest, Mode

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="a torch built without oneDNN"
)


def test_every_linear_is_prepacked_and_the_state_dict_and_tied_weights_are_unchanged(
    checkpoint_dir,
):
    model = load_model(checkpoint_dir("llama"), device="cpu", dtype="float32").model
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == before
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert prepack_linears(model) == 0  # packing twice packs nothing


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_a_prepacked_linear_computes_what_nn_linear_computes(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    reference = torch.nn.Linear(96, 200)
    reference.load_state_dict(linear.state_dict())
    prepack_linears(linear)
    assert isinstance(linear, PrepackedLinear)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), reference(x), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_repacked():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48, bias=False)
    prepack_linears(linear)
    x = torch.randn(4, 32)
    with torch.no_grad():
        linear.weight.mul_(2.0)
        torch.testing.assert_close(linear(x), x @ linear.weight.t(), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_are_left_as_they_are():
    linear = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert not available(linear)
    assert prepack_linears(linear) == 0 and type(linear) is torch.nn.Linear


def test_an_engine_asked_to_prepacks_its_linears_and_prefills_as_one_that_is_not(
    checkpoint_dir, make_chunks
):
    request = GenerateRequest(question="what is it?", chunks=make_chunks(2), mode=Mode.FULL_PREFILL)
    logits = []
    for prepacked in (False, True):
        engine = Engine.from_pretrained(checkpoint_dir("llama"), cpu_prepacked_linear=prepacked)
        try:
            linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
            assert all(isinstance(m, PrepackedLinear) == prepacked for m in linears)
            logits.append(engine.prefill(request).output.logits)
        finally:
            engine.close()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
