"""Every zoo model compiled with backend="comera" matches eager: loss and every parameter gradient."""

import copy

import pytest
import torch

from zoo import ZOO, loss_and_grads

TOL = {"autocast": dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_matches_eager(name, inner, dynamic):
    torch.manual_seed(0)
    cls = ZOO[name]
    model = cls()
    ref_model = copy.deepcopy(model)
    inputs = cls.example(seed=1)
    ref_loss, ref_grads = loss_and_grads(ref_model, [t.clone() for t in inputs])

    compiled = torch.compile(model, backend="comera", dynamic=dynamic, options={"inner": inner})
    loss, grads = loss_and_grads(compiled, [t.clone() for t in inputs], params_of=model)
    tol = TOL.get(name, dict(rtol=2e-4, atol=2e-5))
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **tol, msg=lambda m: f"{key}: {m}")

    if not dynamic:
        return
    # dynamic=True: a differently shaped batch runs through the same symbolic graph and still matches.
    inputs2 = cls.example(batch=5, seed=2)
    ref_loss2, _ = loss_and_grads(ref_model, [t.clone() for t in inputs2])
    loss2, _ = loss_and_grads(compiled, [t.clone() for t in inputs2], params_of=model)
    torch.testing.assert_close(loss2, ref_loss2, **tol)


@pytest.mark.parametrize("name", ["gpt_tied", "bert_mlm"])
def test_zoo_no_grad(name):
    cls = ZOO[name]
    model = cls()
    inputs = cls.example(seed=3)
    with torch.no_grad():
        ref = model(*inputs)
        out = torch.compile(model, backend="comera", options={"inner": "aot_eager"})(*inputs)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)
