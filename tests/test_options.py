import pytest
import torch

import comera_compile as cc
from comera_compile.options import CompileOptions, OptionsError


def test_defaults():
    opts = CompileOptions()
    assert opts.inner == "inductor" and not opts.strict and not opts.cudagraphs


def test_fused_loss_policy_defaults_are_the_cost_rules():
    """The options' policy choices and memory threshold are the ones the cost rule defines."""
    from comera_compile.cce import planner as plan
    from comera_compile.options import CCE_POLICIES

    opts = CompileOptions()
    assert opts.cce_policy == "memory" and CCE_POLICIES == plan.POLICIES
    assert opts.cce_memory_threshold == plan.DEFAULT_MEMORY_THRESHOLD == 64 << 20


@pytest.mark.parametrize("bad, needle", [
    ({"innr": "eager"}, "valid keys"),
    ({"inner": "tvm"}, "['inductor', 'aot_eager', 'eager']"),
    ({"strict": "yes"}, "must be a bool"),
    ({"cce_backward": "fast"}, "['filtered', 'exact']"),
    ({"cce_filter_eps": 2.0}, "[0, 1)"),
    ({"cce_min_vocab": -1}, ">= 0"),
    ({"cce_policy": "fast"}, "option 'cce_policy' got 'fast'; valid values: ['memory', 'speed']"),
    ({"cce_memory_threshold": -1}, "option 'cce_memory_threshold' must be >= 0 bytes"),
    ({"cce_memory_threshold": 1.5}, "option 'cce_memory_threshold' must be a byte count (int)"),
    ({"cce_memory_threshold": True}, "option 'cce_memory_threshold' must be a byte count (int)"),
    ({"passes": {"cce": "off"}}, "True/False"),
])
def test_bad_options_name_the_valid_choices(bad, needle):
    with pytest.raises(OptionsError) as err:
        CompileOptions.from_user(bad)
    assert needle in str(err.value)


def test_bad_mode():
    with pytest.raises(OptionsError, match="reduce-overhead"):
        CompileOptions.from_user(None, mode="fastest")


def test_mode_reduce_overhead_turns_on_cudagraphs():
    assert CompileOptions.from_user(None, mode="reduce-overhead").cudagraphs
    assert CompileOptions.from_user(None, mode="max-autotune-no-cudagraphs").max_autotune
    assert not CompileOptions.from_user(None, mode="max-autotune-no-cudagraphs").cudagraphs


def test_cc_compile_validates_before_tracing():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    with pytest.raises(OptionsError, match="valid keys"):
        cc.compile(f, options={"nope": 1})
    assert calls == []


def test_unknown_option_through_torch_compile_fails_before_any_pass():
    def f(x):
        return x * 2

    with pytest.raises(Exception) as err:
        torch.compile(f, backend="comera", options={"inner": "bogus"})(torch.ones(3))
    assert "['inductor', 'aot_eager', 'eager']" in str(err.value)


def test_unknown_pass_name():
    with pytest.raises(Exception, match="registered passes"):
        torch.compile(lambda x: x + 1, backend="comera",
                      options={"inner": "eager", "passes": {"no-such-pass": False}})(torch.ones(2))


def test_cc_compile_refuses_an_unknown_pass_name_before_the_first_call():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    with pytest.raises(OptionsError, match=r"unknown pass\(es\) \['no-such-pass'\].*registered passes: .*cce"):
        cc.compile(f, options={"passes": {"no-such-pass": True}})
    assert calls == []
    with pytest.raises(OptionsError, match=r"unknown pass\(es\) \['no-such-pass'\]"):
        cc.hf.compile(torch.nn.Linear(2, 2), options={"passes": {"no-such-pass": True}}, fused_loss=False)
    compiled = cc.compile(f, options={"inner": "eager", "passes": {"cce": False}})  # a known name: accepted
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))


def test_cudagraphs_default_is_auto_and_modes_force_it():
    assert CompileOptions().cudagraphs is None
    assert CompileOptions.from_user({"cudagraphs": False}, mode="default").cudagraphs is False
    assert CompileOptions.from_user({"cudagraphs": False}, mode="reduce-overhead").cudagraphs is True
    assert CompileOptions.from_user(None, mode="max-autotune-no-cudagraphs").cudagraphs is False
    with pytest.raises(OptionsError, match="cudagraphs"):
        CompileOptions(cudagraphs="yes")


def test_auto_cudagraphs_only_for_gpu_graphs_with_tensor_train_sites():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from comera_compile.pass_manager import PassContext
    from comera_compile.report import GraphReport, RewriteRecord

    with FakeTensorMode():
        on_gpu, on_cpu = [torch.empty(2, device="cuda")], [torch.empty(2)]
    tt, cce = GraphReport(index=0), GraphReport(index=1)
    tt.rewrites.append(RewriteRecord("tt_linear", "fc"))
    cce.rewrites.append(RewriteRecord("cce", "head"))

    def auto(report, inputs):
        ctx = PassContext(options=CompileOptions(), training=True, report=report, example_inputs=inputs)
        if report is tt:  # what the tensor-network pass asks for when it lowers a layer (test_pass_manager
            ctx.request_cudagraphs("1 tensor-train site(s)")  # checks that it does)
        return ctx.cudagraphs()

    assert auto(tt, on_gpu) is True
    assert auto(tt, on_cpu) is False
    assert auto(cce, on_gpu) is False
