"""torch.ops._C registration: defining the schema where vllm._C is absent, overriding its kernel where present."""

import math

import torch

from biv100_patch.patches import dispatcher, families
from tests.fake_vllm import family_arguments, v2_buffers
from tests.reference import reference_attention
from tests.vllm_patch_check import make_case

FAMILY = families.FAMILIES[3]  # 0.7.0-0.24.x: Tensor scales


def test_overrides_an_existing_kernel_and_revert_restores_it():
    # Stand-in for vllm._C: the family's schema with a CPU kernel that marks its output.
    native = torch.library.Library("_C", "FRAGMENT")
    native_calls = []

    def native_kernel(out, *args):
        native_calls.append(args[0].shape)
        out.fill_(-7.0)
    try:
        for name in families.OP_NAMES:
            native.define(FAMILY.schema(name))
            native.impl(name, native_kernel, "CPU")
        torch.library._impls.difference_update(native._op_impls)  # as if registered from C++

        case = make_case(torch, torch.float32, [600, 20], head_size=64)
        routed = []

        def ours(**kwargs):
            routed.append(sorted(kwargs))
            from biv100_patch.kernels import get_backend
            get_backend("torch").paged_attention_v2(**kwargs)
        registration = dispatcher.register(FAMILY, {"paged_attention_v1": ours, "paged_attention_v2": ours}, "CPU")
        assert registration.as_dict() == {"dispatch_key": "CPU", "defined": [],
                                          "replaced": ["paged_attention_v1", "paged_attention_v2"]}
        out = torch.full_like(case["query"], math.nan)
        torch.ops._C.paged_attention_v2(*family_arguments(FAMILY.name, "paged_attention_v2", case, out,
                                                          v2_buffers(case)))
        assert native_calls == [] and "exp_sum" in routed[0] and "k_scale" in routed[0]
        assert (out.double() - reference_attention(**case)["out"]).abs().max().item() < 1e-4

        registration.remove()
        torch.ops._C.paged_attention_v2(*family_arguments(FAMILY.name, "paged_attention_v2", case, out,
                                                          v2_buffers(case)))
        assert len(native_calls) == 1 and bool((out == -7.0).all())
        assert hasattr(torch.ops._C, "paged_attention_v2")  # vLLM's definition is not ours to remove
    finally:
        dispatcher._drop_library(native)
        for name in families.OP_NAMES:
            vars(torch.ops._C).pop(name, None)


def test_refuses_a_foreign_schema():
    foreign = torch.library.Library("_C", "FRAGMENT")
    try:
        foreign.define("paged_attention_v1(Tensor! out, Tensor query) -> ()")
        try:
            dispatcher.register(FAMILY, {}, "CPU")
        except RuntimeError as error:
            assert "not the 0.7.0-0.24.x family's" in str(error)
        else:
            raise AssertionError("register accepted a foreign schema")
        assert not hasattr(torch.ops._C, "paged_attention_v2")  # nothing half-registered
    finally:
        dispatcher._drop_library(foreign)
        for name in families.OP_NAMES:
            vars(torch.ops._C).pop(name, None)
